"""``fl_lightning/engine/stacked_nets.py``: forward passes and gradients over stacked clients (``sequential_forward``,
``_max_pool``, ``stacked_forward``, per-sample losses, ``pad_rows``, ``relu_net_gradient``) against each client's own
module, autograd or numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

import fl_lightning.engine.stacked as executors
from fl_lightning.engine.stacked_nets import (
    _max_pool,
    per_sample_loss_for,
    sequential_forward,
    stackable,
    stacked_forward,
    unstack,
)
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import Concat, Mask, SplitModel
from tests.helpers.asserts import assert_close_finite


def test_stacked_flatten_with_end_dim_zero_is_each_clients_module() -> None:
    module = nn.Sequential(nn.Flatten(0, 0), nn.Linear(4, 2))
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    params = {n: torch.randn(3, *p.shape, generator=g) for n, p in module.named_parameters()}
    got = stacked_forward(module, params, x)
    for k in range(3):
        mine = {n: v[k] for n, v in params.items()}
        assert_close_finite(got[k], functional_call(module, mine, (x[k],)), rtol=1e-5, atol=1e-6)


def _calls_of(module: nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_trailing_relu_pool_pair_runs_without_the_pool_module_under_no_grad() -> None:
    """A ``ReLU`` then a plain 2×2 ``MaxPool2d`` ending the ``Sequential`` are fused like any other such pair:
    under no-grad the pool is two strided maxima (the module's forward is not called), with the module's values."""
    from fl_lightning.engine.stacked_nets import sequential_forward

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    calls = _calls_of(net[2])
    params = {n: p.detach() for n, p in net.named_parameters()}
    x = torch.randn(3, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = sequential_forward(net, params, x)
    assert calls == []
    with torch.no_grad():
        want = F.max_pool2d(F.relu(F.conv2d(x, params["0.weight"], params["0.bias"], padding=1)), 2)
    assert_close_finite(got, want, rtol=1e-6, atol=1e-7)


def test_a_relu_after_a_linear_layer_runs_in_place_without_the_module() -> None:
    """A ``ReLU`` on a tensor the pass made (a linear layer's output) is applied in place, not by calling the
    module; the values are the module's."""
    from fl_lightning.engine.stacked_nets import sequential_forward

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    calls = _calls_of(net[1])
    params = {n: p.detach() for n, p in net.named_parameters()}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    got = sequential_forward(net, params, x)
    assert calls == []
    hidden = (x @ params["0.weight"].T + params["0.bias"]).clamp(min=0)
    assert_close_finite(got, hidden @ params["2.weight"].T + params["2.bias"], rtol=1e-6, atol=1e-7)


# ---- _max_pool ---------------------------------------------------------------------------------------------------
POOLS = {
    "int_2x2": dict(kernel_size=2, stride=2),
    "tuple_2x2": dict(kernel_size=(2, 2), stride=(2, 2)),
    "kernel3": dict(kernel_size=3, stride=2),
    "stride3": dict(kernel_size=2, stride=3),
    "padding": dict(kernel_size=2, stride=2, padding=1),
    "dilation": dict(kernel_size=2, stride=2, dilation=2),
    "ceil": dict(kernel_size=2, stride=2, ceil_mode=True),
    "tuple_kernel_rows": dict(kernel_size=(3, 2), stride=(2, 2)),
    "tuple_kernel_cols": dict(kernel_size=(2, 3), stride=(2, 2)),
    "tuple_stride_rows": dict(kernel_size=(2, 2), stride=(3, 2)),
    "tuple_stride_cols": dict(kernel_size=(2, 2), stride=(2, 3)),
    "tuple_padding": dict(kernel_size=(2, 2), stride=(2, 2), padding=1),
    "tuple_dilation": dict(kernel_size=(2, 2), stride=(2, 2), dilation=2),
    "tuple_ceil": dict(kernel_size=(2, 2), stride=(2, 2), ceil_mode=True),
}


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (2, 3, 9, 7), (3, 7, 9)])
@pytest.mark.parametrize("name", list(POOLS))
def test_max_pool_without_grad_equals_max_pool2d(name: str, shape: tuple[int, ...]) -> None:
    """Any pool setting, odd non-square images, batched (4-D) or not (3-D): ``F.max_pool2d``'s values."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = _max_pool(nn.MaxPool2d(**POOLS[name]), x)
    expected = F.max_pool2d(x, **POOLS[name])
    assert got.shape == expected.shape
    assert_close_finite(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["int_2x2", "tuple_2x2"])
def test_max_pool_with_grad_gives_max_pool2d_gradients_on_ties(name: str) -> None:
    """With autograd on, the gradient of a window with tied maxima goes to ONE element (``max_pool2d``), not
    half to each (as an elementwise ``maximum`` would give)."""
    x = torch.randint(0, 2, (2, 3, 6, 6), generator=torch.Generator().manual_seed(0)).float()
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    _max_pool(nn.MaxPool2d(**POOLS[name]), a).sum().backward()
    F.max_pool2d(b, 2, 2).sum().backward()
    assert set(a.grad.unique().tolist()) <= {0.0, 1.0}
    assert_close_finite(a.grad, b.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["int_2x2", "tuple_2x2"])
def test_plain_2x2_pool_without_grad_skips_max_pool2d(name: str) -> None:
    """The plain 2×2 pool of an image batch without autograd runs as two elementwise maxima: the pool module (and
    its ``max_pool2d`` with argmax indices) is not called; with autograd on it is."""
    pool = nn.MaxPool2d(**POOLS[name])
    calls: list[int] = []
    pool.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = _max_pool(pool, x)
    assert calls == []
    assert_close_finite(got, F.max_pool2d(x, 2, 2), rtol=0, atol=0)
    _max_pool(pool, x)
    assert calls == [1]


# ---- sequential_forward, stacked_forward, helpers ----------------------------------------------------------------
def plain_forward(module: nn.Module, params: dict[str, Tensor], x: Tensor) -> Tensor:
    return functional_call(module, params, (x,))


SEQUENTIALS = {
    "relu_first": lambda: nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)),
    "tanh_relu": lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.Tanh(), nn.ReLU(), nn.Linear(5, 3)),
    "conv_relu_pool": lambda: nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)
    ),
    "conv_relu_pool3": lambda: nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten()),
    "sigmoid_relu": lambda: nn.Sequential(nn.Sigmoid(), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2)),
    "split": lambda: SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.ReLU()), nn.Linear(4, 3)),
    "split_conv": lambda: SplitModel(
        nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()), nn.Linear(8, 3)
    ),
    "conv": lambda: nn.Conv2d(1, 2, 3),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", list(SEQUENTIALS))
def test_sequential_forward_equals_the_module_and_leaves_its_input_alone(name: str, grad: bool) -> None:
    """``sequential_forward``: the module's outputs (and gradients), the caller's input unchanged (in-place ReLUs
    only on tensors the pass made)."""
    torch.manual_seed(0)
    module = SEQUENTIALS[name]()
    g = torch.Generator().manual_seed(4)  # weights other than the module's own
    params = {n: torch.randn(p.shape, generator=g).requires_grad_(grad) for n, p in module.named_parameters()}
    x = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    before = x.clone()
    with torch.set_grad_enabled(grad):
        got = sequential_forward(module, params, x)
    assert_close_finite(x, before, rtol=0, atol=0)
    ref_params = {n: p.detach().clone().requires_grad_(grad) for n, p in params.items()}
    with torch.set_grad_enabled(grad):
        expected = plain_forward(module, ref_params, x.clone())
    assert_close_finite(got.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    if grad:
        names = list(params)
        g1 = torch.autograd.grad(got.square().sum(), [params[n] for n in names])
        g2 = torch.autograd.grad(expected.square().sum(), [ref_params[n] for n in names])
        for n, a, b in zip(names, g1, g2):
            assert_close_finite(a, b, rtol=1e-6, atol=1e-7, msg=n)


def test_sequential_forward_runs_a_side_free_split_body_on_its_fast_path_and_refuses_a_side_branch() -> None:
    """A split model without a side branch runs its ``Sequential`` body piece by piece (its plain 2×2 pool without
    ``max_pool2d`` under no-grad); one with a side branch is the module's own forward, which needs the side input."""
    torch.manual_seed(0)
    net = SEQUENTIALS["split_conv"]()
    calls: list[int] = []
    net.body[2].register_forward_hook(lambda *_: calls.append(1))
    params = {n: p.detach() for n, p in net.named_parameters()}
    x = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = sequential_forward(net, params, x)
        expected = net(x)
    assert calls == [1]  # only the module's own forward called the pool
    assert_close_finite(got, expected, rtol=1e-6, atol=1e-7)
    masked = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 4)), nn.Linear(4, 3), Mask(nn.Linear(2, 4)))
    with pytest.raises(ValueError, match="side"):
        sequential_forward(masked, dict(masked.named_parameters()), x)


@pytest.mark.parametrize("start,end", [(1, -1), (0, -1), (-2, -1), (-3, -2), (0, 1), (1, 2)])
def test_stacked_forward_flatten_and_linear_equal_each_clients_module(start: int, end: int) -> None:
    """Per client k, ``stacked_forward`` is the module on ``x[k]`` with client k's weights: ``Flatten`` with
    positive and negative dims, ``Linear`` with and without bias, inside a ``Sequential``."""
    torch.manual_seed(0)
    flat = nn.Flatten(start, end)
    x = torch.randn(3, 2, 2, 3, 4, generator=torch.Generator().manual_seed(6))  # [K, B, 2, 3, 4]
    width = flat(x[0]).shape[-1]
    module = nn.Sequential(flat, nn.Linear(width, 5), nn.GELU(), nn.Linear(5, 2, bias=False))
    assert stackable(module)
    g = torch.Generator().manual_seed(8)
    params = {n: torch.randn(3, *p.shape, generator=g) for n, p in module.named_parameters()}
    got = stacked_forward(module, params, x)
    for k in range(3):
        assert_close_finite(got[k], plain_forward(module, unstack(params, k), x[k]), rtol=1e-5, atol=1e-6)


def test_stacked_forward_keeps_negative_flatten_dims_as_they_are() -> None:
    """A negative ``Flatten`` dim counts from the end, which the client dim in front does not move:
    ``Flatten(-3, -2)`` on ``[K, B, 2, 3, 4]`` gives each client's ``[B, 6, 4]``."""
    flat = nn.Flatten(-3, -2)
    x = torch.randn(2, 2, 2, 3, 4, generator=torch.Generator().manual_seed(6))
    assert stacked_forward(flat, {}, x).shape == (2, 2, 6, 4)
    assert torch.equal(stacked_forward(flat, {}, x)[1], x[1].reshape(2, 6, 4))


def test_stackable_names_what_stacked_forward_computes() -> None:
    """Linear, Flatten, elementwise activations, Sequentials and side-free split models of them; not convolutions,
    side branches or other modules (``stacked_forward`` refuses those)."""
    assert stackable(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Flatten(), nn.Identity()))
    assert stackable(SplitModel(nn.Linear(2, 2), nn.Sequential(nn.Tanh(), nn.Linear(2, 1))))
    assert not stackable(nn.Sequential(nn.Linear(2, 2), nn.Conv2d(1, 1, 1)))
    assert not stackable(SplitModel(nn.Linear(2, 2), nn.Linear(2, 1), nn.Linear(2, 2)))
    assert not stackable(SplitModel(nn.Linear(2, 2), nn.Conv2d(1, 1, 1)))
    assert not stackable(nn.Dropout())
    with pytest.raises(TypeError, match="Conv2d"):
        stacked_forward(nn.Conv2d(1, 1, 1), {}, torch.zeros(1, 1, 1, 2, 2))


def test_per_sample_losses_average_to_the_sequential_losses() -> None:
    """Per sample: cross-entropy, or ½·mean squared error over each sample's outputs."""
    g = torch.Generator().manual_seed(9)
    out, y = torch.randn(5, 4, generator=g), torch.randint(0, 4, (5,), generator=g)
    ce = per_sample_loss_for(4)(out, y)
    logp = out - out.exp().sum(1, keepdim=True).log()
    assert_close_finite(ce, -logp[torch.arange(5), y], rtol=1e-6, atol=1e-7)
    target = torch.randn(5, 2, 2, generator=g)
    pred = torch.randn(5, 2, 2, generator=g)
    se = per_sample_loss_for(None)(pred, target)
    assert se.shape == (5,)
    assert_close_finite(se, 0.5 * ((pred - target) ** 2).sum((1, 2)) / 4, rtol=1e-6, atol=1e-7)


def test_network_kind_probes_and_feature_chunks() -> None:
    """``has_conv``/``has_rnn``/``has_batchnorm`` find nested layers; ``feature_chunk`` is 100 rows on the CPU and
    larger elsewhere."""
    from fl_lightning.engine.sequential import has_batchnorm
    from fl_lightning.engine.stacked import FEATURE_CHUNK, feature_chunk
    from fl_lightning.engine.stacked_nets import has_conv, has_rnn

    nested = nn.Sequential(nn.Sequential(nn.Conv1d(1, 1, 1)), nn.LSTM(2, 2), nn.BatchNorm1d(2))
    assert has_conv(nested) and has_rnn(nested) and has_batchnorm(nested)
    plain = nn.Sequential(nn.Linear(2, 2))
    assert not (has_conv(plain) or has_rnn(plain) or has_batchnorm(plain))
    assert feature_chunk(torch.device("cpu")) == FEATURE_CHUNK == 100
    assert feature_chunk(torch.device("cuda")) > 1000


def test_stacked_forward_of_a_split_model_equals_each_clients_forward() -> None:
    """A side-free split model: client k's body then head with client k's ``body.``/``head.`` weights."""
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 3))
    x = torch.randn(3, 5, 2, 3, generator=torch.Generator().manual_seed(6))
    g = torch.Generator().manual_seed(8)
    params = {n: torch.randn(3, *p.shape, generator=g) for n, p in net.named_parameters()}
    got = stacked_forward(net, params, x)
    for k in range(3):
        assert_close_finite(got[k], plain_forward(net, unstack(params, k), x[k]), rtol=1e-5, atol=1e-6)


Params = dict[str, Tensor]


def test_pad_rows_zero_pads_every_client_to_the_longest() -> None:
    from fl_lightning.engine.stacked_nets import pad_rows

    rows = [torch.arange(6.0).reshape(3, 2), torch.ones(1, 2), torch.zeros(0, 2)]
    out = pad_rows(rows)
    assert out.shape == (3, 3, 2) and out.dtype == torch.float32
    assert torch.equal(out[0], rows[0]) and torch.equal(out[1], torch.tensor([[1.0, 1.0], [0, 0], [0, 0]]))
    assert not out[2].any()
    one = pad_rows([torch.arange(4).reshape(2, 2)])  # a single client, integer rows
    assert one.shape == (1, 2, 2) and one.dtype == torch.int64 and torch.equal(one[0], torch.arange(4).reshape(2, 2))


# ---- relu_layers / relu_net_gradient ------------------------------------------------------------------------------
def _numpy_relu_net(layers: list[tuple[np.ndarray, np.ndarray | None]], x: np.ndarray, y: np.ndarray, m: np.ndarray):
    """One client's masked mean cross-entropy of a ReLU MLP and its gradient, by hand in numpy (float64)."""
    hs, h = [], x.reshape(x.shape[0], -1)
    for i, (w, b) in enumerate(layers):
        hs.append(h)
        h = h @ w.T + (0.0 if b is None else b)
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    z = h - h.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    n = max(m.sum(), 1.0)
    loss = float((-np.log(p[np.arange(len(y)), y]) * m).sum() / n)
    d = p.copy()
    d[np.arange(len(y)), y] -= 1.0
    d *= (m / n)[:, None]
    grads = []
    for i in range(len(layers) - 1, -1, -1):
        w, b = layers[i]
        grads.append((d.T @ hs[i], None if b is None else d.sum(0)))
        d = (d @ w) * (hs[i] > 0) if i > 0 else d @ w
    return loss, grads[::-1]


def _relu_clients(net: nn.Module, seed: int, rows: int, real_rows_of_client_1: int):
    """3 clients' float64 parameters of ``net``, inputs ``[3, rows, 2, 3]``, labels of 3 classes and the row mask:
    client 0 all rows real, client 1 its first ``real_rows_of_client_1``, client 2 none."""
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(3, *p.shape, generator=g, dtype=torch.float64) for n, p in net.named_parameters()}
    x = torch.randn(3, rows, 2, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (3, rows), generator=g)
    mask = torch.ones(3, rows, dtype=torch.float64)
    mask[1, real_rows_of_client_1:] = 0
    mask[2] = 0
    return params, x, y, mask


def test_relu_net_gradient_is_each_clients_backpropagation_by_hand() -> None:
    """A Flatten + Linear/ReLU body and a bias-free head, 3 clients with their own parameters, one with padded
    rows and one without any: every client's loss and gradient equal a numpy backpropagation of its own MLP, for
    every trainable subset (a frozen layer on top still passes the gradient down)."""
    net = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU()),
                     nn.Linear(4, 3, bias=False))  # fmt: skip
    layers = executors.relu_layers(net)
    assert [kind for kind, _ in layers] == ["flatten", "linear", "relu", "linear", "relu", "linear"]
    k = 3
    params, x, y, mask = _relu_clients(net, seed=4, rows=7, real_rows_of_client_1=4)
    names = ["body.1", "body.3", "head"]
    for trainable in (set(params), {"head.weight"}, {"body.1.weight", "body.1.bias"}, {"body.3.bias"}):
        grads, losses = executors.relu_net_gradient(layers, params, x, y, mask, trainable)
        assert set(grads) == trainable
        for c in range(k):
            mine = [(params[f"{n}.weight"][c].numpy(), params[f"{n}.bias"][c].numpy() if f"{n}.bias" in params
                     else None) for n in names]  # fmt: skip
            loss, expected = _numpy_relu_net(mine, x[c].numpy(), y[c].numpy(), mask[c].numpy())
            assert abs(losses[c].item() - loss) < 1e-12
            for n, (gw, gb) in zip(names, expected):
                if f"{n}.weight" in trainable:
                    np.testing.assert_allclose(grads[f"{n}.weight"][c].numpy(), gw, rtol=1e-10, atol=1e-12)
                if f"{n}.bias" in trainable:
                    np.testing.assert_allclose(grads[f"{n}.bias"][c].numpy(), gb, rtol=1e-10, atol=1e-12)
        assert losses[2].item() == 0.0 and all(not grads[n][2].any() for n in grads)


def test_relu_layers_refuses_other_layers() -> None:
    assert executors.relu_layers(nn.Sequential(nn.Linear(3, 2), nn.Tanh())) is None
    assert executors.relu_layers(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())) is None
    assert executors.relu_layers(DigitsCNN()) is None
    assert executors.relu_layers(SplitModel(nn.Linear(3, 2), nn.Linear(4, 2), Concat(nn.Linear(2, 2)))) is None
    assert [kind for kind, _ in executors.relu_layers(DigitsMLP())] == [
        "flatten", "linear", "relu", "linear", "relu", "linear"]  # fmt: skip
    assert [arg for kind, arg in executors.relu_layers(DigitsMLP()) if kind == "linear"] == [
        "body.fc1.", "body.fc2.", "head."]  # fmt: skip


def test_relu_net_gradient_passes_through_adjacent_linear_layers() -> None:
    """Two linear layers in a row (no ReLU between), only the lower one trained: its gradient comes through the
    upper one as each client's own autograd gives it."""
    net = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))
    g = torch.Generator().manual_seed(6)
    params = {n: torch.randn(2, *p.shape, generator=g, dtype=torch.float64) for n, p in net.named_parameters()}
    x = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.float64)
    grads, losses = executors.relu_net_gradient(executors.relu_layers(net), params, x, y, mask, {"0.weight", "0.bias"})
    for k in range(2):
        w0, b0 = params["0.weight"][k].clone().requires_grad_(True), params["0.bias"][k].clone().requires_grad_(True)
        out = (x[k] @ w0.T + b0) @ params["1.weight"][k].T + params["1.bias"][k]
        loss = F.cross_entropy(out, y[k])
        gw, gb = torch.autograd.grad(loss, [w0, b0])
        assert_close_finite(grads["0.weight"][k], gw, rtol=1e-12, atol=1e-14)
        assert_close_finite(grads["0.bias"][k], gb, rtol=1e-12, atol=1e-14)
        assert abs(losses[k].item() - loss.item()) < 1e-12


def _own_masked_loss_and_grads(net: nn.Module, mine: Params, x: Tensor, y: Tensor, m: Tensor, names: list[str]):
    """One client's masked mean cross-entropy Σ m_b·ce_b / max(Σ m_b, 1) of its own module and autograd's gradient
    for ``names`` (plain torch, float64)."""
    leaves = {n: v.clone().requires_grad_(True) for n, v in mine.items()}
    ce = F.cross_entropy(functional_call(net, leaves, (x,)), y, reduction="none")
    loss = (ce * m).sum() / m.sum().clamp(min=1)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names]) if names else ()
    return loss.detach(), dict(zip(names, grads))


def test_relu_net_gradient_through_flattens_inside_the_network_is_each_clients_autograd() -> None:
    """Flatten layers between the linear ones (``Flatten(-2, -1)`` joining a row's two linear outputs,
    ``Flatten(1, 1)`` and ``Flatten(0, 0)``, which leave one client's rows as they are), the lowest layer first in
    the list; 3 clients with 5 rows: all real, one real row, none. Every trainable subset (the lowest layer's
    weight or bias alone, nothing) gives each client's own loss and autograd gradient."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Flatten(-2, -1), nn.Linear(8, 5), nn.ReLU(), nn.Flatten(1, 1),
                        nn.Flatten(0, 0), nn.Linear(5, 3))  # fmt: skip
    layers = executors.relu_layers(net)
    assert [kind for kind, _ in layers] == ["linear", "relu", "flatten", "linear", "relu", "flatten", "flatten",
                                            "linear"]  # fmt: skip
    k = 3
    params, x, y, mask = _relu_clients(net, seed=8, rows=5, real_rows_of_client_1=1)
    for trainable in (set(params), {"0.weight"}, {"0.bias"}, {"3.bias", "7.weight"}, set()):
        grads, losses = executors.relu_net_gradient(layers, params, x, y, mask, trainable)
        assert set(grads) == trainable
        for c in range(k):
            mine = {n: v[c] for n, v in params.items()}
            loss, expected = _own_masked_loss_and_grads(net, mine, x[c], y[c], mask[c], sorted(trainable))
            assert abs(losses[c].item() - loss.item()) < 1e-12, (trainable, c)
            for n in trainable:
                assert_close_finite(grads[n][c], expected[n], rtol=1e-10, atol=1e-12, msg=f"{trainable} {c} {n}")
    assert losses[1].item() > 0 and losses[2].item() == 0.0


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_stacked_mlp_gradients_equal_each_clients_own(act, task):
    """One batched forward of K clients' MLPs, autograd on the sum of their losses: client c's gradient is the one
    of its own loss alone (plain autograd, one client at a time)."""
    torch.manual_seed(0)
    out_dim = 4 if task == "classification" else 1
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), act(), nn.Linear(5, out_dim))
    if task == "regression":
        net.append(nn.Flatten(0))  # [B, 1] → [B]: one output per sample
    assert stackable(net)
    k, b = 3, 5
    params = {n: torch.randn(k, *p.shape) for n, p in net.named_parameters()}
    x = torch.randn(k, b, 2, 3)
    y = torch.randint(0, 4, (k, b)) if task == "classification" else torch.randn(k, b)
    mask = torch.ones(k, b)
    mask[1, 3:] = 0  # a short last batch
    loss = per_sample_loss_for(4 if task == "classification" else None)
    leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
    out = stacked_forward(net, leaves, x)
    losses = (loss(out.flatten(0, 1), y.flatten(0, 1)).view(k, b) * mask).sum(1) / mask.sum(1)
    grads = dict(zip(leaves, torch.autograd.grad(losses.sum(), list(leaves.values()))))
    for c in range(k):  # the reference: client c alone, plain autograd
        own = {n: v[c].clone().requires_grad_(True) for n, v in params.items()}
        m = mask[c].bool()
        pred = functional_call(net, own, (x[c][m],))
        ref = F.cross_entropy(pred, y[c][m]) if task == "classification" else (0.5 * (pred - y[c][m]) ** 2).mean()
        ref_grads = torch.autograd.grad(ref, list(own.values()))
        assert_close_finite(losses[c], ref.detach(), rtol=1e-5, atol=1e-6)
        for n, g in zip(own, ref_grads):
            assert_close_finite(grads[n][c], g, rtol=1e-5, atol=1e-6, msg=n)
