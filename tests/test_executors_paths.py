"""The vectorized executor's client-by-client paths and helpers, against independent references.

* ``conv_clients``: the CPU runs convolutional phases client by client, other devices ``vmap`` them;
* ``_max_pool``: ``max_pool2d``'s values (and gradients) for every pool setting and input rank, and the plain 2×2
  no-grad pool without ``max_pool2d``;
* ``_sgd_in_turn`` (the CPU's convolutional phases): bit for bit a plain torch loop over each client's batches
  with torch's fused SGD (``channels_last``), the phase's own learning rate, ``max_steps``, losses and step counts;
* ``_sgd_client_by_client`` (client optimisers without a batched form): bit for bit the sequential
  ``ClientContext`` (in ``channels_last``), with per-client penalty data, side information, a custom step
  direction, the phase's learning rate and ``max_steps``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.nn import functional as F

from fl_lightning.client import ClientContext, ClientOptimizer, Penalty, loss_fn_for
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.stacked import (
    VectorizedContext,
    _max_pool,
    conv_clients,
    per_sample_loss_for,
    sequential_forward,
    stackable,
    stacked_forward,
    unstack,
)
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import Concat, Mask, SplitModel

CL = torch.channels_last


# ---- conv_clients ------------------------------------------------------------------------------------------------
def test_conv_clients_loops_on_the_cpu_and_vmaps_on_other_devices() -> None:
    """``CONV_CLIENTS``: ``loop`` on the CPU; any device type it does not name gets ``vmap``."""
    assert conv_clients(torch.device("cpu")) == "loop"
    assert conv_clients(torch.device("cuda")) == "vmap"
    assert conv_clients(torch.device("meta")) == "vmap"


def test_a_conv_net_on_the_cpu_runs_client_by_client_by_default() -> None:
    """``loop_over_clients`` defaults to True for a convolutional net on the CPU, False for an MLP."""
    xs, ys = [torch.rand(3, 1, 8, 8)], [torch.zeros(3, dtype=torch.long)]

    def context(net: nn.Module) -> VectorizedContext:
        opt = ClientOptimizer()
        return VectorizedContext(net, [0], xs, ys, None, opt, per_sample_loss_for(10), [torch.Generator()], None, 0,
                                 0, [1.0])  # fmt: skip

    assert context(DigitsCNN()).loop_over_clients is True
    assert context(DigitsMLP()).loop_over_clients is False


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


# ---- shared data -------------------------------------------------------------------------------------------------
SIZES = [9, 3, 12]


def images(sizes: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 8, 8, generator=g) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    return xs, ys


def generators(n: int) -> list[torch.Generator]:
    return [make_generator(5, "train", 0, k) for k in range(n)]


# ---- _sgd_in_turn ------------------------------------------------------------------------------------------------
def fused_sgd_reference(
    net: nn.Module,
    glob: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    g: torch.Generator,
    *,
    lr: float,
    momentum: float,
    wd: float,
    bs: int,
    epochs: int,
    max_steps: int | None,
) -> tuple[dict[str, Tensor], float, int]:
    """One client in plain torch: per epoch a ``randperm`` of its rows, minibatches in order, cross-entropy, torch's
    fused SGD; weights and images in ``channels_last``. Returns the weights, the mean step loss and the steps."""
    params = {
        n: (v.detach().clone().contiguous(memory_format=CL) if v.dim() == 4 else v.detach().clone()).requires_grad_()
        for n, v in glob.items()
    }
    opt = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum, weight_decay=wd, fused=True)
    steps, losses = 0, []
    for _ in range(epochs):
        perm = torch.randperm(x.shape[0], generator=g)
        for i in range(0, x.shape[0], bs):
            if max_steps is not None and steps >= max_steps:
                break
            idx = perm[i : i + bs]
            opt.zero_grad()
            loss = F.cross_entropy(functional_call(net, params, (x[idx].contiguous(memory_format=CL),)), y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            steps += 1
    return {n: v.detach() for n, v in params.items()}, sum(losses) / max(steps, 1), steps


@pytest.mark.parametrize("epochs,max_steps", [(2, 4), (1, None)])
def test_cpu_conv_phase_in_turn_is_a_fused_sgd_loop_bit_for_bit(epochs: int, max_steps: int | None) -> None:
    """The CPU's convolutional phase (``_sgd_in_turn``): each client's weights exactly as a plain torch loop with
    torch's fused SGD at the phase's learning rate (not the round's), capped at ``max_steps``; its mean step loss
    (a client with a single step included) and step count."""
    torch.manual_seed(0)
    net = DigitsCNN()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    xs, ys = images(SIZES)
    opt = ClientOptimizer(lr=0.05, momentum=0.9, weight_decay=1e-3, batch_size=4)
    vctx = VectorizedContext(net, range(3), xs, ys, None, opt, per_sample_loss_for(10), generators(3), None, 0, 5,
                             [1.0] * 3)  # fmt: skip
    assert vctx.loop_over_clients
    expanded = {n: v.expand(3, *v.shape) for n, v in glob.items()}
    out = vctx.sgd(expanded, list(glob), epochs, lr=0.07, max_steps=max_steps)
    for k, g in enumerate(generators(3)):
        ref, loss, steps = fused_sgd_reference(
            net, glob, xs[k], ys[k], g, lr=0.07, momentum=0.9, wd=1e-3, bs=4, epochs=epochs, max_steps=max_steps
        )
        for n in glob:
            assert_close_finite(out[n][k], ref[n], rtol=0, atol=0, msg=f"{n} client {k}")
        assert int(vctx.steps_taken[k]) == steps
        assert_close_finite(vctx.train_loss[k], loss, rtol=1e-6, atol=1e-7, msg=f"loss client {k}")
    if max_steps is None:
        assert int(vctx.steps_taken[1]) == 1  # the 3-sample client takes one step: its loss is that step's


# ---- _sgd_client_by_client ---------------------------------------------------------------------------------------
def rmsprop(lr: float = 0.05, bs: int = 4) -> ClientOptimizer:
    """A client optimiser without a batched form: the vectorized executor runs its clients in turn."""
    return ClientOptimizer(lr=lr, batch_size=bs, factory=functools.partial(torch.optim.RMSprop, lr=lr))


def anchor_penalty(params: dict[str, Tensor], data: dict[str, Tensor]) -> Tensor:
    """A FedProx-style term pulling the head towards the client's own anchor."""
    return 0.5 * ((params["head.weight"] - data["anchor"]) ** 2).sum()


def test_clients_in_turn_equal_the_sequential_loop_bit_for_bit_with_penalty_data_lr_and_max_steps() -> None:
    """A client optimiser with no batched form on a conv net: every client's weights, loss and steps exactly as
    ``ClientContext.sgd`` in ``channels_last`` with the client's own penalty anchor, the phase's learning rate and
    ``max_steps``."""
    torch.manual_seed(0)
    net = DigitsCNN()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    xs, ys = images(SIZES)
    opt = rmsprop()
    anchors = torch.randn(3, *glob["head.weight"].shape, generator=torch.Generator().manual_seed(4))
    vctx = VectorizedContext(net, range(3), xs, ys, None, opt, per_sample_loss_for(10), generators(3), None, 0, 5,
                             [1.0] * 3)  # fmt: skip
    expanded = {n: v.expand(3, *v.shape) for n, v in glob.items()}
    out = vctx.sgd(expanded, list(glob), 2, Penalty(anchor_penalty, {"anchor": anchors}), lr=0.02, max_steps=4)
    for k, g in enumerate(generators(3)):
        seq = ClientContext(net, k, xs[k], ys[k], None, opt, loss_fn_for(10), g, channels_last=True)
        ref = seq.sgd(glob, list(glob), 2, Penalty(anchor_penalty, {"anchor": anchors[k]}), lr=0.02, max_steps=4)
        for n in glob:
            assert_close_finite(out[n][k], ref[n], rtol=0, atol=0, msg=f"{n} client {k}")
        assert int(vctx.steps_taken[k]) == min(4, 2 * -(-SIZES[k] // 4))
        assert_close_finite(vctx.train_loss[k], seq.train_loss, rtol=1e-6, atol=1e-7)
    assert not torch.equal(out["head.weight"][0], glob["head.weight"])


class TinySide(SplitModel):
    """A body, a side branch concatenating W(z), a head: linear layers only."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(5, 3), Concat(nn.Linear(2, 2)))


def side_data() -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, 4, generator=g) for n in (6, 5)]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in (6, 5)]
    sides = [torch.randn(2, generator=g) for _ in range(2)]
    return xs, ys, sides


@pytest.mark.parametrize("custom_gradient", [False, True])
def test_clients_in_turn_see_their_own_side_information(custom_gradient: bool) -> None:
    """Side information reaches each client's forward in turn, also inside a custom step direction written with
    the vectorized context's ``batch_loss``: the sequential loop's weights exactly."""
    torch.manual_seed(0)
    net = TinySide()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    xs, ys, sides = side_data()
    opt = rmsprop(bs=3)
    vctx = VectorizedContext(net, range(2), xs, ys, sides, opt, per_sample_loss_for(3), generators(2), None, 0, 5,
                             [1.0] * 2)  # fmt: skip
    trained = [n for n in glob if not n.startswith("body.")]

    def gradient_for(ctx: ClientContext | VectorizedContext):
        def gradient(params: dict[str, Tensor], x: Tensor, y: Tensor, mask: Tensor):
            return grad_and_value(lambda q: ctx.batch_loss({**params, **q}, x, y, mask))(
                {n: params[n] for n in trained}
            )

        return gradient if custom_gradient else None

    expanded = {n: v.expand(2, *v.shape) for n, v in glob.items()}
    out = vctx.sgd(expanded, trained, 2, gradient=gradient_for(vctx))
    for k, g in enumerate(generators(2)):
        seq = ClientContext(net, k, xs[k], ys[k], sides[k], opt, loss_fn_for(3), g, channels_last=True)
        ref = seq.sgd(glob, trained, 2, gradient=gradient_for(seq))
        for n in glob:
            assert_close_finite(out[n][k], ref[n], rtol=0, atol=0, msg=f"{n} client {k}")
        assert int(vctx.steps_taken[k]) == 2 * -(-xs[k].shape[0] // 3)
    assert not torch.equal(out["side.embed.weight"][0], out["side.embed.weight"][1])


def test_a_custom_step_direction_in_turn_leaves_batch_loss_plain_afterwards() -> None:
    """After a phase with a custom step direction run client by client, the context's ``batch_loss`` of one
    client's weights is the plain cross-entropy of the network (no client's side input left behind)."""
    torch.manual_seed(0)
    net = DigitsMLP()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    xs, ys = images([6, 5])
    vctx = VectorizedContext(net, range(2), xs, ys, None, rmsprop(), per_sample_loss_for(10), generators(2), None,
                             0, 5, [1.0] * 2)  # fmt: skip

    def gradient(params: dict[str, Tensor], x: Tensor, y: Tensor, mask: Tensor):
        return grad_and_value(lambda q: vctx.batch_loss({**params, **q}, x, y, mask))(dict(params))

    expanded = {n: v.expand(2, *v.shape) for n, v in glob.items()}
    out = vctx.sgd(expanded, list(glob), 1, gradient=gradient)
    mine = unstack(out, 1)
    got = vctx.batch_loss(mine, xs[1], ys[1])
    assert_close_finite(got, F.cross_entropy(functional_call(net, mine, (xs[1],)), ys[1]), rtol=1e-6, atol=1e-7)


# ---- BatchedSGD / BatchedAdam ------------------------------------------------------------------------------------
RULES = {
    "sgd_plain": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_maximize_wd": (torch.optim.SGD, dict(lr=0.1, weight_decay=0.05, maximize=True)),
    "sgd_momentum_maximize": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, maximize=True)),
    "sgd_dampening": (torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3, weight_decay=0.02)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.7, nesterov=True, weight_decay=0.02)),
    "adam": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)),
    "adam_maximize_amsgrad": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.9), amsgrad=True, maximize=True)),
    "adam_decoupled": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)),
    "adamw_maximize": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, maximize=True)),
}


@pytest.mark.parametrize("name", list(RULES))
def test_batched_rules_step_each_client_as_its_torch_optimizer(name: str) -> None:
    """The stacked optimiser rule, with client k joining at step k (masked as the executor masks), gives each
    client what its own ``torch.optim`` optimiser gives after its own steps (float64, 1e-12)."""
    from fl_lightning.engine.stacked import batched_rule

    cls, hyper = RULES[name]
    settings = ClientOptimizer.from_config(functools.partial(cls, **hyper))
    rule = batched_rule(settings)
    assert rule is not None
    g = torch.Generator().manual_seed(3)
    k_clients, steps = 3, 5
    start = torch.randn(k_clients, 4, 3, generator=g, dtype=torch.float64)
    grads = torch.randn(steps, k_clients, 4, 3, generator=g, dtype=torch.float64)
    p, state = start.clone(), rule.init(start)
    count = torch.zeros(k_clients, dtype=torch.long)
    wd = rule.weight_decay
    for t in range(steps):
        active = torch.arange(k_clients) <= t
        new_p, new_state = rule.step(p, grads[t], state, count, hyper["lr"], wd)
        mask = active.view(-1, 1, 1)
        p = torch.where(mask, new_p, p)
        state = {key: torch.where(active.view(-1, *[1] * (v.dim() - 1)), v, state[key]) for key, v in new_state.items()}
        count = count + active.long()
    for k in range(k_clients):
        leaf = start[k].clone().requires_grad_(True)
        opt = cls([leaf], **hyper)
        for t in range(k, steps):
            leaf.grad = grads[t, k].clone()
            opt.step()
        assert_close_finite(p[k], leaf.detach(), rtol=1e-12, atol=1e-12, msg=f"client {k}")
    assert not torch.equal(p[0], start[0])


def test_batched_rule_is_none_without_a_batched_form() -> None:
    """Optimisers the executor cannot stack: another class, a tensor learning rate."""
    from fl_lightning.engine.stacked import BatchedAdam, BatchedSGD, batched_rule

    def rule(cls: type, **hyper: object):
        return batched_rule(ClientOptimizer(factory=functools.partial(cls, **hyper)))

    assert rule(torch.optim.RMSprop, lr=0.01) is None
    assert rule(torch.optim.Adam, lr=torch.tensor(0.01)) is None
    assert isinstance(rule(torch.optim.SGD, lr=0.01), BatchedSGD)
    assert isinstance(rule(torch.optim.Adam, lr=0.01), BatchedAdam) and not rule(torch.optim.Adam, lr=0.01).decoupled
    assert rule(torch.optim.AdamW, lr=0.01).decoupled
    assert rule(torch.optim.Adam, lr=0.01, decoupled_weight_decay=True).decoupled
    assert isinstance(batched_rule(ClientOptimizer()), BatchedSGD)


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


@pytest.mark.parametrize("start,end", [(1, -1), (0, -1), (-2, -1), (0, 1), (1, 2)])
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
    from fl_lightning.engine.stacked import FEATURE_CHUNK, feature_chunk, has_batchnorm, has_conv, has_rnn

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
