"""Corners of the vectorized executor the path tests do not reach:

* ``batched_rule``: a differentiable optimiser has no batched form; ``AdamW`` is decoupled and ``Adam`` is not,
  also on a torch whose ``defaults`` do not name ``decoupled_weight_decay`` (torch < 2.6);
* ``BatchedSGD`` without momentum keeps no state (as ``torch.optim.SGD``: no momentum buffer);
* ``stacked_forward``: a ``Flatten`` whose end dim is 0 (a no-op per client);
* ``VectorizedContext``: no clients (CPU, empty losses and step counts, parameters returned as given), its
  device, losses and step counts on the clients' device (``meta`` standing in for a GPU), and a fresh context's
  ``batch_loss`` being the plain loss (no side input).
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_close_finite
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.stacked import (
    BatchedAdam,
    BatchedSGD,
    VectorizedContext,
    batched_rule,
    per_sample_loss_for,
    stacked_forward,
)

SGD_HYPER = {"weight_decay": 0.0, "momentum": 0, "dampening": 0, "nesterov": False, "maximize": False}


def test_a_differentiable_optimizer_has_no_batched_form() -> None:
    """``defaults["differentiable"]`` (the probe cannot step such an optimiser, so it is handed over unstepped)."""
    for differentiable, expected in ((True, type(None)), (False, BatchedSGD)):
        settings = ClientOptimizer(factory=functools.partial(torch.optim.SGD, lr=0.01))
        probe = torch.optim.SGD([torch.zeros(2, 3, requires_grad=True)], lr=0.01, differentiable=differentiable)
        object.__setattr__(settings, "probe", lambda probe=probe: probe)
        assert isinstance(batched_rule(settings), expected)


@pytest.mark.parametrize(("cls", "decoupled"), [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_adamw_is_decoupled_without_the_defaults_key(cls: type, decoupled: bool) -> None:
    """Older torch (< 2.6) has no ``decoupled_weight_decay`` in ``defaults``: the class alone decides."""
    settings = ClientOptimizer(factory=functools.partial(cls, lr=0.01))
    probe = settings.probe()
    probe.defaults.pop("decoupled_weight_decay", None)
    object.__setattr__(settings, "probe", lambda: probe)
    rule = batched_rule(settings)
    assert isinstance(rule, BatchedAdam)
    assert rule.decoupled is decoupled


def test_sgd_without_momentum_keeps_no_state() -> None:
    rule = BatchedSGD(SGD_HYPER)
    assert rule.keys == ()
    assert rule.init(torch.zeros(3, 2)) == {}
    with_momentum = BatchedSGD({**SGD_HYPER, "momentum": 0.5})
    assert with_momentum.keys == ("momentum_buffer",)
    assert set(with_momentum.init(torch.zeros(3, 2))) == {"momentum_buffer"}


def test_stacked_flatten_with_end_dim_zero_is_each_clients_module() -> None:
    module = nn.Sequential(nn.Flatten(0, 0), nn.Linear(4, 2))
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    params = {n: torch.randn(3, *p.shape, generator=g) for n, p in module.named_parameters()}
    got = stacked_forward(module, params, x)
    for k in range(3):
        mine = {n: v[k] for n, v in params.items()}
        assert_close_finite(got[k], functional_call(module, mine, (x[k],)), rtol=1e-5, atol=1e-6)


def context(xs: list[torch.Tensor], ys: list[torch.Tensor], net: nn.Module | None = None) -> VectorizedContext:
    net = nn.Linear(4, 3) if net is None else net
    n = len(xs)
    return VectorizedContext(net, range(n), xs, ys, None, ClientOptimizer(), per_sample_loss_for(3),
                             [torch.Generator() for _ in range(n)], None, 0, 0, [1.0] * n)  # fmt: skip


def test_a_context_without_clients_is_on_the_cpu_and_returns_its_parameters() -> None:
    ctx = context([], [])
    assert ctx.num_clients == 0
    assert ctx.device == torch.device("cpu")
    assert ctx.train_loss.shape == (0,) and ctx.steps_taken.shape == (0,)
    assert ctx.steps_taken.dtype == torch.long
    params = {"weight": torch.zeros(0, 3, 4), "bias": torch.zeros(0, 3)}
    out = ctx.sgd(params, ["weight", "bias"], 1)
    assert set(out) == {"weight", "bias"} and out["weight"].shape == (0, 3, 4)


def test_context_state_lives_on_the_clients_device() -> None:
    xs = [torch.empty(5, 4, device="meta"), torch.empty(3, 4, device="meta")]
    ys = [torch.empty(5, dtype=torch.long, device="meta"), torch.empty(3, dtype=torch.long, device="meta")]
    ctx = context(xs, ys)
    assert ctx.device.type == "meta"
    assert ctx.train_loss.device.type == "meta" and ctx.train_loss.shape == (2,)
    assert ctx.steps_taken.device.type == "meta" and ctx.steps_taken.shape == (2,)
    assert ctx.steps_taken.dtype == torch.long and ctx.train_loss.dtype == torch.get_default_dtype()


def test_fresh_context_batch_loss_is_the_plain_loss() -> None:
    g = torch.Generator().manual_seed(3)
    xs, ys = [torch.randn(6, 4, generator=g)], [torch.randint(0, 3, (6,), generator=g)]
    net = nn.Linear(4, 3)
    ctx = context(xs, ys, net)
    params = {n: p.detach() for n, p in net.named_parameters()}
    got = ctx.batch_loss(params, xs[0], ys[0])
    want = F.cross_entropy(xs[0] @ params["weight"].T + params["bias"], ys[0])
    assert_close_finite(got, want, rtol=1e-6, atol=1e-7)


def _calls_of(module: nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_trailing_relu_pool_pair_runs_without_the_pool_module_under_no_grad() -> None:
    """A ``ReLU`` then a plain 2×2 ``MaxPool2d`` ending the ``Sequential`` are fused like any other such pair:
    under no-grad the pool is two strided maxima (the module's forward is not called), with the module's values."""
    from fl_lightning.engine.stacked import sequential_forward

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
    from fl_lightning.engine.stacked import sequential_forward

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    calls = _calls_of(net[1])
    params = {n: p.detach() for n, p in net.named_parameters()}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    got = sequential_forward(net, params, x)
    assert calls == []
    hidden = (x @ params["0.weight"].T + params["0.bias"]).clamp(min=0)
    assert_close_finite(got, hidden @ params["2.weight"].T + params["2.bias"], rtol=1e-6, atol=1e-7)
