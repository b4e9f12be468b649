"""``fl_lightning/engine/sequential.py`` (the sequential implementation of the client contract): ``ClientContext.sgd``
and ``batches``, the kept client optimiser state, ``FunctionalBatchNorm``, ``to_device`` and the step helpers, against
plain-torch references and hand-computed steps."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedAvg
from fl_lightning.client import ClientOptimizer, Objective, Penalty
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import (
    ClientContext,
    FunctionalBatchNorm,
    add_gradient,
    class_sum_step,
    draws_ahead,
    epoch_draws,
    load_state,
    loss_fn_for,
    save_state,
    state_keys,
    state_template,
    step_limit,
    steps_per_epoch,
    to_device,
)
from fl_lightning.engine.state import state_name
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.digits_mlp import LR, MOMENTUM, assert_params_close, client_data, params_of


def test_weight_decay_on_weights_only():
    """decay_bias=False: SGD weight decay 1e-2 on weights, none on biases (plain torch param groups)."""
    torch.manual_seed(0)
    net = DigitsMLP()
    x, y = client_data()
    glob = params_of(net)
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, weight_decay=1e-2, batch_size=10_000, decay_bias=False)
    ctx = client_context(net, x, y, optimizer=opt, loss=F.cross_entropy)
    upd = FedAvg(local_epochs=3).client_update(ctx, glob, {})
    ref = copy.deepcopy(net)
    weights = [p for n, p in ref.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in ref.named_parameters() if n.endswith("bias")]
    sgd = torch.optim.SGD(
        [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "weight_decay": 0.0}], lr=LR, momentum=MOMENTUM
    )
    for _ in range(3):
        sgd.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        sgd.step()
    assert_params_close(upd.upload, params_of(ref), glob)


def _kept(name: str, steps: int, step: float, avg: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        state_name("steps", name): torch.tensor(steps, dtype=torch.long),
        state_name("step", name): torch.tensor(step),
        state_name("exp_avg", name): avg.clone(),
    }


def _group_opt(leaf: torch.Tensor, **flags: bool) -> torch.optim.Optimizer:
    """An optimiser whose only group carries ``flags`` (``fused``, ``capturable``), as torch's Adam sets them."""
    opt = torch.optim.SGD([leaf], lr=0.1)
    opt.param_groups[0].update(flags)
    return opt


def test_load_state_puts_scalar_state_on_the_cpu_unless_fused_or_capturable() -> None:
    """Scalar state (Adam's ``step``) goes to the CPU for a plain group and to the leaf's device for a fused or
    a capturable group; tensor state keeps its values; a leaf that never stepped gets no state."""
    avg = torch.tensor([0.25, -0.5, 1.5])
    cases: list[tuple[dict[str, bool], str]] = [
        ({}, "cpu"),
        ({"fused": True}, "meta"),
        ({"capturable": True}, "meta"),
        ({"fused": True, "capturable": False}, "meta"),
        ({"fused": False, "capturable": True}, "meta"),
    ]
    for flags, device in cases:
        leaf = torch.empty(3, device="meta", requires_grad=True)
        opt = _group_opt(leaf, **flags)
        load_state(opt, {"w": leaf}, _kept("w", 4, 4.0, avg))
        state = opt.state[leaf]
        assert sorted(state) == ["exp_avg", "step"]
        assert state["step"].device.type == device, flags
        assert state["step"].dim() == 0
        if device == "cpu":
            assert float(state["step"]) == 4.0
        assert state["exp_avg"].device.type == "cpu"
        assert_close_finite(state["exp_avg"], avg)


def test_load_state_scalar_state_values_and_fresh_leaves_on_the_cpu() -> None:
    """On the CPU: the loaded state equals the kept one (copies, not the kept tensors themselves), and a leaf whose
    kept step counter is 0 starts fresh."""
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1)
    kept = {**_kept("a", 2, 2.0, torch.tensor([1.0, 2.0, 3.0])), **_kept("b", 0, 0.0, torch.zeros(3))}
    load_state(opt, {"a": a, "b": b}, kept)
    assert b not in opt.state or not opt.state[b]
    assert float(opt.state[a]["step"]) == 2.0
    assert_close_finite(opt.state[a]["exp_avg"], torch.tensor([1.0, 2.0, 3.0]))
    assert opt.state[a]["exp_avg"].data_ptr() != kept[state_name("exp_avg", "a")].data_ptr()


def _momentum_kept(names: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n in names:
        out[state_name("steps", n)] = torch.tensor(3, dtype=torch.long)
        out[state_name("momentum_buffer", n)] = torch.full((2,), 7.0)
    return out


def test_save_state_skips_a_leaf_without_state_and_saves_the_next() -> None:
    """A leaf the phase never gave a gradient keeps its kept state; the leaves after it are still saved (counter +
    steps, buffer = the optimiser's)."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    opt.state[b]["momentum_buffer"] = torch.tensor([1.0, -1.0])
    kept = _momentum_kept(["a", "b"])
    out = save_state(opt, {"a": a, "b": b}, kept, steps=5)
    assert int(out[state_name("steps", "a")]) == 3
    assert_close_finite(out[state_name("momentum_buffer", "a")], torch.full((2,), 7.0))
    assert int(out[state_name("steps", "b")]) == 8
    assert_close_finite(out[state_name("momentum_buffer", "b")], torch.tensor([1.0, -1.0]))


def test_save_state_casts_to_the_kept_dtype_and_device() -> None:
    """Saved state takes the kept tensor's dtype (float64 optimiser state into a float32 bank) and device (CPU
    state into a bank on another device goes to the bank's device)."""
    a = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    opt.state[a]["momentum_buffer"] = torch.tensor([0.5, 1.0 + 1e-12], dtype=torch.float64)
    out = save_state(opt, {"a": a}, _momentum_kept(["a"]), steps=1)
    buf = out[state_name("momentum_buffer", "a")]
    assert buf.dtype == torch.float32
    assert_close_finite(buf, torch.tensor([0.5, 1.0], dtype=torch.float32))

    m = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([m], lr=0.1, momentum=0.9)
    opt.state[m]["momentum_buffer"] = torch.tensor([1.0, 2.0], dtype=torch.float64)
    kept = _momentum_kept(["m"])
    kept[state_name("momentum_buffer", "m")] = torch.empty(2, device="meta")
    out = save_state(opt, {"m": m}, kept, steps=1)
    buf = out[state_name("momentum_buffer", "m")]
    assert (buf.device.type, buf.dtype, tuple(buf.shape)) == ("meta", torch.float32, (2,))
    assert int(out[state_name("steps", "m")]) == 4


def test_fresh_client_context_reports_no_loss_no_steps_and_no_kept_state() -> None:
    """Before any phase (and after a phase with nothing to train) a client reports loss 0, zero steps as an integer
    tensor, and no kept optimiser state; the phase returns the parameters unchanged."""
    net = nn.Linear(3, 2)
    x, y = torch.ones(4, 3), torch.tensor([0, 1, 0, 1])
    ctx = client_context(net, x, y, loss=F.cross_entropy, generator=make_generator(0, "t", 0, 0))
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    out = ctx.sgd(params, [], epochs=1)
    for n, v in params.items():
        assert torch.equal(out[n], v)
    assert isinstance(ctx.train_loss, float | torch.Tensor)
    assert float(ctx.train_loss) == 0.0
    assert ctx.steps_taken.dtype == torch.long
    assert int(ctx.steps_taken) == 0
    assert ctx.optimizer_state is None


class _Linear(nn.Linear):
    """``nn.Linear(3, 2)`` with the engine's forward signature (``side`` information, unused)."""

    def __init__(self) -> None:
        super().__init__(3, 2)

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


def test_kept_state_takes_the_parameter_dtype_and_continues_adam_in_float64() -> None:
    """A float64 network with kept Adam state (as the linear algorithms run outside ``precision: 64-true``): the
    template's elementwise state is float64 like the parameters, the scalar ``step`` keeps torch's scalar dtype, and
    two full-batch phases continue one plain ``torch.optim.Adam`` run over the same two steps."""
    torch.manual_seed(0)
    net = _Linear().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])
    optimizer = ClientOptimizer.from_config(functools.partial(torch.optim.Adam, lr=0.05), batch_size=6)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    template = state_template(optimizer, params)
    for n, p in params.items():
        assert template[state_name("exp_avg", n)].dtype == torch.float64
        assert template[state_name("exp_avg_sq", n)].shape == p.shape
        assert template[state_name("step", n)].dtype == torch.get_default_dtype()
        assert template[state_name("steps", n)].dtype == torch.long
    ctx = client_context(net, x, y, optimizer=optimizer, loss=F.cross_entropy, generator=make_generator(0, "t", 0, 0))
    ctx.optimizer_state = template
    out = ctx.sgd(ctx.sgd(params, list(params), epochs=1), list(params), epochs=1)

    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    reference = torch.optim.Adam(list(leaves.values()), lr=0.05)
    for _ in range(2):
        reference.zero_grad()
        F.cross_entropy(x @ leaves["weight"].T + leaves["bias"], y).backward()
        reference.step()
    for n, leaf in leaves.items():
        assert out[n].dtype == torch.float64
        assert_close_finite(out[n], leaf.detach(), rtol=1e-12, atol=1e-12)
        assert_close_finite(ctx.optimizer_state[state_name("exp_avg", n)], reference.state[leaf]["exp_avg"])
        assert int(ctx.optimizer_state[state_name("steps", n)]) == 2


SEED = 11


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def _data(n: int = 10, d: int = 3) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


class _Lin(nn.Module):
    """``x·Wᵀ + b`` with parameters named ``weight`` and ``bias``; takes (and ignores) ``side`` like the models."""

    def __init__(self, d: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = nn.Parameter(torch.randn(1, d, generator=g, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(1, generator=g, dtype=torch.float64))

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return x @ self.weight.T + self.bias


class _Seq(nn.Sequential):
    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return super().forward(x)


def _net(d: int = 3) -> nn.Module:
    return _Lin(d)


def _params(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _ctx(net: nn.Module, x: Tensor, y: Tensor, opt: ClientOptimizer, **kw) -> ClientContext:
    return client_context(net, x, y, optimizer=opt, loss=F.mse_loss, generator=_gen(), **kw)


def _reference(
    params: dict[str, Tensor],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    bs: int,
    lr: float,
    momentum: float,
    wd: float = 0.0,
    min_batch: int = 1,
    max_steps: int | None = None,
    loss: Callable[[dict[str, Tensor], Tensor, Tensor], Tensor] | None = None,
    extra_grad: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    bufs: dict[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], list[float], dict[str, Tensor]]:
    """Minibatch momentum SGD written out: (final params, the stepped minibatches' losses, momentum buffers)."""
    p = {n: v.clone() for n, v in params.items()}
    buf = {n: v.clone() for n, v in (bufs or {}).items()}
    loss = loss or (lambda q, xb, yb: F.mse_loss(xb @ q["weight"].T + q["bias"], yb))
    g, losses = _gen(), []
    for _ in range(epochs):
        if max_steps is not None and len(losses) >= max_steps:
            break
        perm = torch.randperm(x.shape[0], generator=g)
        for i in range(0, x.shape[0], bs):
            idx = perm[i : i + bs]
            if len(idx) < min_batch:
                continue
            leaves = {n: v.clone().requires_grad_(True) for n, v in p.items()}
            value = loss(leaves, x[idx], y[idx])
            grads = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
            if extra_grad is not None:
                grads = {n: grads[n] + e for n, e in extra_grad(p).items()}
            for n in p:
                step = grads[n] + wd * p[n]
                buf[n] = step.clone() if n not in buf else momentum * buf[n] + step
                p[n] = p[n] - lr * buf[n]
            losses.append(float(value))
            if max_steps is not None and len(losses) >= max_steps:
                break
    return p, losses, buf


def _check(
    ctx: ClientContext, out: dict[str, Tensor], ref: tuple[dict[str, Tensor], list[float], dict], rtol: float = 1e-10
) -> None:
    params, losses, _ = ref
    for n in params:
        assert_close_finite(out[n], params[n], rtol=rtol, atol=rtol / 100, msg=n)
    assert int(ctx.steps_taken) == len(losses)
    assert_close_finite(ctx.train_loss, sum(losses) / len(losses), rtol=rtol, atol=rtol / 100)


def test_sgd_explicit_batch_size_lr_override_and_min_batch() -> None:
    """``batch_size`` and ``lr`` given to the phase win over the client optimiser's; a last batch smaller than
    ``min_batch`` is skipped, full ones are not."""
    net, (x, y) = _net(), _data(10)
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.3, momentum=0.5, batch_size=100))
    out = ctx.sgd(_params(net), ["weight", "bias"], 2, lr=0.05, batch_size=4, min_batch=4)
    _check(ctx, out, _reference(_params(net), x, y, epochs=2, bs=4, lr=0.05, momentum=0.5, min_batch=4))
    assert int(ctx.steps_taken) == 4


def test_sgd_default_min_batch_steps_on_a_single_sample_batch_and_weight_decay() -> None:
    """Default ``min_batch``: the last batch of one sample is stepped on; weight decay enters every step."""
    net, (x, y) = _net(), _data(9)
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.9, weight_decay=0.2, batch_size=4))
    out = ctx.sgd(_params(net), ["weight", "bias"], 1)
    _check(ctx, out, _reference(_params(net), x, y, epochs=1, bs=4, lr=0.1, momentum=0.9, wd=0.2))
    assert int(ctx.steps_taken) == 3


@pytest.mark.parametrize("max_steps", [3, 1])
def test_sgd_max_steps_stops_exactly(max_steps: int) -> None:
    """``max_steps`` with 3 batches per epoch and 2 epochs: exactly that many steps, and with one step
    ``train_loss`` is that minibatch's loss."""
    net, (x, y) = _net(), _data(10)
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.5, batch_size=4))
    out = ctx.sgd(_params(net), ["weight", "bias"], 2, max_steps=max_steps)
    _check(ctx, out, _reference(_params(net), x, y, epochs=2, bs=4, lr=0.1, momentum=0.5, max_steps=max_steps))
    assert int(ctx.steps_taken) == max_steps


def test_sgd_max_steps_function_is_asked_with_the_clients_size_and_budget() -> None:
    """``max_steps`` as a function ``(num_samples, step_budget) -> steps``: asked once with the client's own, and
    its answer caps the phase (2 of the 3 steps a budget of ¾ allows)."""
    net, (x, y) = _net(), _data(10)
    asked: list[tuple[int, float]] = []

    def cap(n: int, budget: float) -> int:
        asked.append((n, budget))
        return 2

    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.5, batch_size=4), step_budget=0.75)
    out = ctx.sgd(_params(net), ["weight", "bias"], 2, max_steps=cap)
    _check(ctx, out, _reference(_params(net), x, y, epochs=2, bs=4, lr=0.1, momentum=0.5, max_steps=2))
    assert asked == [(10, 0.75)]


def test_sgd_straggler_budget_counts_only_batches_of_min_batch() -> None:
    """Budget ½ over 2 epochs of 10 samples in batches of 4 with ``min_batch`` 3: 2 steppable batches per epoch,
    so ⌊½·2·2⌋ = 2 steps."""
    net, (x, y) = _net(), _data(10)
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.5, batch_size=4), step_budget=0.5)
    out = ctx.sgd(_params(net), ["weight", "bias"], 2, min_batch=3)
    _check(ctx, out, _reference(_params(net), x, y, epochs=2, bs=4, lr=0.1, momentum=0.5, max_steps=2))


def test_sgd_plain_function_penalty_and_objective() -> None:
    """A plain ``params -> Tensor`` penalty is added to every minibatch loss; ``objective`` replaces the loss (the
    mean of its per-sample losses, its per-client data passed to it)."""
    net, (x, y) = _net(), _data(10)
    mu = 0.7
    data = {"scale": torch.tensor(0.1, dtype=torch.float64)}

    def per_sample(q: dict[str, Tensor], xb: Tensor, yb: Tensor, d: dict[str, Tensor]) -> Tensor:
        return ((xb @ q["weight"].T + q["bias"] - yb).abs() ** 3).mean(1) + d["scale"] * xb.sum(1) * q["bias"].sum()

    def objective(q: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return ((xb @ q["weight"].T + q["bias"] - yb).abs() ** 3).mean() + 0.1 * xb.sum() / len(xb) * q["bias"].sum()

    def penalty(q: dict[str, Tensor]) -> Tensor:
        return 0.5 * mu * (q["weight"] ** 2).sum()

    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.05, momentum=0.5, batch_size=4))
    out = ctx.sgd(_params(net), ["weight", "bias"], 1, penalty=penalty, objective=Objective(per_sample, data))
    ref = _reference(
        _params(net),
        x,
        y,
        epochs=1,
        bs=4,
        lr=0.05,
        momentum=0.5,
        loss=lambda q, xb, yb: objective(q, xb, yb) + penalty(q),
    )
    _check(ctx, out, ref)


def test_sgd_closed_form_penalty_gradient_is_added_to_the_loss_gradient() -> None:
    """A ``Penalty`` with its gradient in closed form (½μ‖w‖² with μw) steps as the same penalty through autograd;
    its value is in the reported loss."""
    net, (x, y) = _net(), _data(10)
    mu = 0.7
    data = {"mu": torch.tensor(mu, dtype=torch.float64)}
    penalty = Penalty(lambda q, d: 0.5 * d["mu"] * (q["weight"] ** 2).sum(), data,
                      gradient=lambda q, d: {"weight": d["mu"] * q["weight"]})  # fmt: skip
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.05, momentum=0.5, batch_size=4))
    out = ctx.sgd(_params(net), ["weight", "bias"], 1, penalty=penalty)

    def loss(q: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return F.mse_loss(xb @ q["weight"].T + q["bias"], yb) + 0.5 * mu * (q["weight"] ** 2).sum()

    ref = _reference(_params(net), x, y, epochs=1, bs=4, lr=0.05, momentum=0.5, loss=loss)
    _check(ctx, out, ref)


def test_sgd_custom_gradient_plus_the_penalty_gradient() -> None:
    """With ``gradient``, the step direction is its gradient plus the penalty's gradient (μ·w for ½μ‖w‖²)."""
    net, (x, y) = _net(), _data(10)
    mu = 0.4

    def gradient(values: dict[str, Tensor], xb: Tensor, yb: Tensor, mask: Tensor) -> tuple[dict, Tensor]:
        def loss(q: dict[str, Tensor]) -> Tensor:
            return 2.0 * F.mse_loss(xb @ q["weight"].T + q["bias"], yb)

        grads = torch.func.grad(loss)({n: values[n] for n in ("weight", "bias")})
        return grads, loss(values)

    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.05, momentum=0.5, batch_size=4))
    out = ctx.sgd(_params(net), ["weight", "bias"], 1, penalty=lambda q: 0.5 * mu * (q["weight"] ** 2).sum(),
                  gradient=gradient)  # fmt: skip
    ref = _reference(
        _params(net),
        x,
        y,
        epochs=1,
        bs=4,
        lr=0.05,
        momentum=0.5,
        loss=lambda q, xb, yb: 2.0 * F.mse_loss(xb @ q["weight"].T + q["bias"], yb),
        extra_grad=lambda q: {"weight": mu * q["weight"], "bias": torch.zeros_like(q["bias"])},
    )
    _check(ctx, out, ref)


def _collect_values(q: dict[str, Tensor], xb: Tensor, yb: Tensor, d: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """An objective that reports 3 per sample instead of its loss, and collects values ``10·x + 1`` that do not
    depend on the parameters being trained."""
    per = (xb @ q["weight"].T + q["bias"]).squeeze(1) ** 2
    return per, torch.full_like(per, 3.0), 10 * xb + 1


def test_objective_collect_sums_the_last_epochs_values_by_class() -> None:
    """``Objective.collect``: ``class_sums_seen`` holds the per-class sums and counts of the values the objective
    returns, over the phase's last epoch only (2 epochs of 4 samples in batches of 2: every row once), in the
    values' dtype; ``train_loss`` is the mean of what it reports; a phase that trains nothing leaves zeros on the
    data's device (``meta`` stands in for an accelerator)."""
    net, (x, _) = _net(), _data(4)
    y = torch.tensor([0, 2, 1, 0])
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.5, batch_size=2))
    ctx.sgd(_params(net), ["weight", "bias"], 2, objective=Objective(_collect_values, collect=(3, 3)))
    sums, counts = ctx.class_sums_seen
    values, labels = (10 * x + 1).numpy(), y.numpy()
    assert sums.dtype == counts.dtype == torch.float64
    assert_close_finite(sums, np.stack([values[labels == c].sum(0) for c in range(3)]), rtol=1e-12, atol=0)
    assert counts.tolist() == [2.0, 1.0, 1.0]
    assert float(ctx.train_loss) == 3.0
    meta = _ctx(net, x.to("meta"), y.to("meta"), ClientOptimizer(batch_size=4))
    meta.sgd(_params(net), ["weight", "bias"], 0, objective=Objective(_collect_values, collect=(3, 3)))
    assert [(t.device.type, tuple(t.shape)) for t in meta.class_sums_seen] == [("meta", (3, 3)), ("meta", (3,))]


def test_objective_collect_sums_on_the_datas_device() -> None:
    """A phase that trains on another device (``meta`` here) collects its class sums there."""
    net, (x, _) = _net(), _data(4)
    y = torch.tensor([0, 2, 1, 0])
    meta = _ctx(net, x.to("meta"), y.to("meta"), ClientOptimizer(batch_size=4))
    meta.sgd({n: v.to("meta") for n, v in _params(net).items()}, ["weight", "bias"], 1,
             objective=Objective(_collect_values, collect=(3, 3)))  # fmt: skip
    assert [(t.device.type, tuple(t.shape)) for t in meta.class_sums_seen] == [("meta", (3, 3)), ("meta", (3,))]


def test_a_step_direction_on_a_batchnorm_network_updates_its_statistics_and_sets_values() -> None:
    """A ``Gradient`` through ``ctx.batch_loss`` on a BatchNorm1d network (float64): each step normalises with the
    batch's statistics and the running statistics move as torch's BatchNorm moves them in train mode; the untrained
    value the direction sets (``2.bias`` + 1 per step) is taken, and a penalty's closed-form gradient for one trained
    tensor is added. Against ``functional_call`` and momentum SGD written out over the context's shuffle (3 batches
    of 2: two values per channel, where the unbiased variance doubles); after the phase ``batch_loss`` is the plain
    loss."""
    torch.manual_seed(0)
    net = _Seq(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    start = {n: t.detach().clone() for n, t in {**dict(net.named_parameters()), **dict(net.named_buffers())}.items()}
    start["1.running_var"] += 0.5  # not the default statistics, so that a fresh start would show
    trained = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    opt = ClientOptimizer(lr=0.1, momentum=0.5, batch_size=2)
    ctx = client_context(net, x, y, optimizer=opt, loss=F.cross_entropy, generator=_gen())

    def gradient(p: dict[str, Tensor], xb: Tensor, yb: Tensor, m: Tensor) -> tuple[dict, Tensor, dict]:
        g, loss = torch.func.grad_and_value(lambda q: ctx.batch_loss({**p, **q}, xb, yb, m))({n: p[n] for n in trained})
        return g, loss, {"2.bias": p["2.bias"] + 1}

    mu = 0.3  # a penalty whose closed-form gradient names one of the trained tensors only
    penalty = Penalty(lambda q, d: 0.5 * mu * (q["0.weight"] ** 2).sum(),
                      gradient=lambda q, d: {"0.weight": mu * q["0.weight"]})  # fmt: skip
    out = ctx.sgd(start, trained, 1, penalty, gradient=gradient)
    want, buf = {n: v.clone() for n, v in start.items()}, {}
    perm = torch.randperm(6, generator=_gen())
    for idx in perm.split(2):
        leaves = {n: v.clone().requires_grad_(n in trained) for n, v in want.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x[idx],)), y[idx])  # updates the statistics
        grads = dict(zip(trained, torch.autograd.grad(loss, [leaves[n] for n in trained])))
        want.update({n: leaves[n].detach() for n in want if n not in trained})
        grads["0.weight"] = grads["0.weight"] + mu * leaves["0.weight"].detach()
        for n in trained:
            buf[n] = grads[n] if n not in buf else 0.5 * buf[n] + grads[n]
            want[n] = want[n] - 0.1 * buf[n]
        want["2.bias"] = want["2.bias"] + 1
    for n in start:
        assert_close_finite(out[n], want[n], rtol=1e-9, atol=1e-10, msg=n)
    with torch.no_grad():  # after the phase, batch_loss is the plain loss again (eval-mode statistics)
        net.eval()
        expected = F.cross_entropy(torch.func.functional_call(net, out, (x,)), y)
        assert_close_finite(ctx.batch_loss(out, x, y), expected, rtol=1e-12, atol=1e-12)


def test_sgd_continues_from_the_kept_momentum_and_saves_it_back() -> None:
    """With a kept state (momentum buffers from earlier rounds, step counters 5), the phase starts from those
    buffers and writes the new ones back, counters + steps."""
    net, (x, y) = _net(), _data(10)
    opt = ClientOptimizer(lr=0.1, momentum=0.9, batch_size=4)
    params = _params(net)
    kept = state_template(opt, params)
    assert sorted(kept) == sorted(state_name(k, n) for k in ("steps", "momentum_buffer") for n in params)
    bufs = {
        "weight": torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64),
        "bias": torch.tensor([0.5], dtype=torch.float64),
    }
    for n in params:
        kept[state_name("steps", n)] = torch.tensor(5)
        kept[state_name("momentum_buffer", n)] = bufs[n].float()
    ctx = _ctx(net, x, y, opt)
    ctx.optimizer_state = kept
    out = ctx.sgd(params, ["weight", "bias"], 1)
    ref = _reference(
        params, x, y, epochs=1, bs=4, lr=0.1, momentum=0.9, bufs={n: b.float().double() for n, b in bufs.items()}
    )
    _check(ctx, out, ref, rtol=1e-5)  # the kept buffers are float32 (the bank's dtype), the parameters float64
    for n in params:
        assert int(ctx.optimizer_state[state_name("steps", n)]) == 8
        assert_close_finite(ctx.optimizer_state[state_name("momentum_buffer", n)], ref[2][n].float(), rtol=1e-5)


def test_sgd_with_no_epochs_does_not_train() -> None:
    """``epochs`` = 0: the parameters come back unchanged and no step is taken."""
    net, (x, y) = _net(), _data(10)
    ctx = _ctx(net, x, y, ClientOptimizer(lr=0.1, momentum=0.5, batch_size=4))
    ctx.steps_taken = torch.tensor(-1)
    out = ctx.sgd(_params(net), ["weight", "bias"], 0)
    for n, v in _params(net).items():
        assert torch.equal(out[n], v)
    assert int(ctx.steps_taken) == -1


class _Scale:
    """An augmentation that draws ahead: a scale per sample, applied as ``x·(1 + s)``."""

    def draw(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.rand(n, generator=generator, dtype=torch.float64)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return x * (1 + drawn.view(-1, *([1] * (x.dim() - 1))))


def test_batches_with_an_augmentation_that_draws_ahead() -> None:
    """One epoch: the shuffle, then one draw per sample in shuffled order, applied batch by batch."""
    x, y = _data(10)
    ctx = _ctx(_net(), x, y, ClientOptimizer(batch_size=4), augment=_Scale())
    got = list(ctx.batches())
    g = _gen()
    perm = torch.randperm(10, generator=g)
    scale = torch.rand(10, generator=g, dtype=torch.float64)
    assert [len(b[0]) for b in got] == [4, 4, 2]
    for j, (xb, yb) in enumerate(got):
        idx = perm[4 * j : 4 * j + 4]
        assert_close_finite(xb, x[idx] * (1 + scale[4 * j : 4 * j + 4, None]))
        assert torch.equal(yb, y[idx])


def test_batches_with_a_per_batch_augmentation_function() -> None:
    """An augmentation that cannot draw ahead is called per batch with the client's generator, after the shuffle."""
    x, y = _data(10)

    def noise(xb: Tensor, g: torch.Generator) -> Tensor:
        return xb + torch.randn(xb.shape, generator=g, dtype=xb.dtype)

    ctx = _ctx(_net(), x, y, ClientOptimizer(batch_size=4), augment=noise)
    got = list(ctx.batches())
    g = _gen()
    perm = torch.randperm(10, generator=g)
    for j, (xb, yb) in enumerate(got):
        idx = perm[4 * j : 4 * j + 4]
        assert_close_finite(xb, x[idx] + torch.randn(x[idx].shape, generator=g, dtype=x.dtype))
        assert torch.equal(yb, y[idx])
    assert len(got) == 3


def test_channels_last_batches_and_phase_keep_values() -> None:
    """``channels_last``: image batches come in that memory layout with the same values; 2-D batches and a
    2-D network are left as they are; a conv phase gives the same parameters as without it."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 2, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(0)
    net = _Seq(nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(12, 3))
    params = _params(net)
    results = []
    for cl in (False, True):
        ctx = client_context(
            net, x, y, optimizer=ClientOptimizer(lr=0.1, batch_size=4), loss=F.cross_entropy, generator=_gen(),
            channels_last=cl,
        )
        batches = list(ctx.batches())
        if cl:
            assert all(b.is_contiguous(memory_format=torch.channels_last) for b, _ in batches)
        results.append(ctx.sgd(params, list(params), 1))
    for n in params:
        assert_close_finite(results[1][n], results[0][n], rtol=1e-5, atol=1e-6, msg=n)
    x2, y2 = _data(5)
    ctx = _ctx(_net(), x2, y2, ClientOptimizer(batch_size=2), channels_last=True)
    assert [tuple(b.shape) for b, _ in ctx.batches()] == [(2, 3), (2, 3), (1, 3)]


class _WithSide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2).double()
        self.register_buffer("offset", torch.tensor([10.0, -10.0], dtype=torch.float64))

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        out = self.lin(x) + self.offset
        return out if side is None else out + side @ torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=x.dtype)


def test_side_information_is_expanded_per_row_and_passed_to_the_network() -> None:
    """``side_for(n)`` repeats the client's side vector n times; ``forward`` passes it as ``side``, and takes the
    module's own buffers for names missing from ``params``."""
    x, y = _data(4)
    side = torch.tensor([0.5, -1.0], dtype=torch.float64)
    net = _WithSide()
    ctx = client_context(net, x, y, side=side, loss=F.mse_loss, generator=_gen())
    assert_close_finite(ctx.side_for(3), side.repeat(3, 1))
    assert ctx.side_for(3).shape == (3, 2)
    params = {n: p.detach() for n, p in net.named_parameters()}
    expected = (
        x @ params["lin.weight"].T
        + params["lin.bias"]
        + torch.tensor([10.0, -10.0], dtype=torch.float64)
        + (side @ torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
    )
    assert_close_finite(ctx.forward(params, x), expected)
    assert client_context(net, x, y, loss=F.mse_loss, generator=_gen()).side_for(3) is None


def test_step_limit_cases() -> None:
    """Full budget: ``max_steps`` (None: no limit); a straggler: ⌊budget·epochs·steppable batches⌋ (≥ 1), capped
    by ``max_steps``."""
    assert step_limit(1.0, 2, 10, 4, None) is None
    assert step_limit(1.5, 2, 10, 4, None) is None
    assert step_limit(1.0, 2, 10, 4, 5) == 5
    assert step_limit(0.5, 2, 10, 4, None, min_batch=3) == 2  # batches 4, 4, (2 < 3 skipped)
    assert step_limit(0.5, 2, 10, 4, None) == 3
    assert step_limit(0.9, 2, 10, 4, 2) == 2
    assert step_limit(0.9, 2, 10, 4, 100) == 5
    assert step_limit(0.01, 1, 10, 4, None) == 1


def test_epoch_draws_and_draws_ahead() -> None:
    """The shuffle first, then the augmentation's draws for all samples, from the same generator; only an
    augmentation with both ``draw`` and ``apply`` draws ahead."""
    perm, drawn = epoch_draws(7, _gen(), _Scale())
    g = _gen()
    assert torch.equal(perm, torch.randperm(7, generator=g))
    assert drawn is not None
    assert_close_finite(drawn, torch.rand(7, generator=g, dtype=torch.float64))
    perm, drawn = epoch_draws(7, _gen(), None)
    assert torch.equal(perm, torch.randperm(7, generator=_gen())) and drawn is None

    class DrawOnly:
        def draw(self, n: int, g: torch.Generator) -> Tensor:
            return torch.zeros(n)

    class ApplyOnly:
        def apply(self, x: Tensor, d: Tensor) -> Tensor:
            return x

    assert draws_ahead(_Scale()) is True
    assert not draws_ahead(None)
    assert not draws_ahead(DrawOnly())
    assert not draws_ahead(ApplyOnly())
    assert not draws_ahead(lambda x, g: x)


def test_to_device() -> None:
    """A CPU target returns the tensor itself; another non-CUDA device (``meta`` here) gets a moved copy."""
    t = torch.arange(3.0)
    assert to_device(t, torch.device("cpu")) is t
    moved = to_device(t, torch.device("meta"))
    assert moved.device.type == "meta" and moved.shape == (3,)


def test_state_template_shapes_follow_the_parameters() -> None:
    """SGD with momentum keeps a momentum buffer shaped like each parameter, and a step counter; Adam its two
    moments and a scalar step; all zeros."""
    params = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}
    sgd = state_template(ClientOptimizer(momentum=0.9), params)
    assert {n: tuple(v.shape) for n, v in sgd.items()} == {
        state_name("steps", "w"): (), state_name("momentum_buffer", "w"): (4, 5),
        state_name("steps", "b"): (), state_name("momentum_buffer", "b"): (5,),
    }  # fmt: skip
    adam = state_template(ClientOptimizer.from_config(functools.partial(torch.optim.Adam, lr=0.1)), params)
    assert {n: tuple(v.shape) for n, v in adam.items() if n.endswith(".w")} == {
        state_name("steps", "w"): (), state_name("step", "w"): (), state_name("exp_avg", "w"): (4, 5),
        state_name("exp_avg_sq", "w"): (4, 5),
    }  # fmt: skip
    assert all(float(v.abs().sum()) == 0 for v in adam.values())
    with pytest.raises(ConfigError, match="not elementwise"):
        state_template(ClientOptimizer.from_config(functools.partial(torch.optim.Adafactor, lr=0.1)), params)


def test_batches_on_another_device_without_augmentation() -> None:
    """Data on a non-CPU device (``meta`` stands in for an accelerator) and no augmentation: the shuffle is moved
    there and the epoch's batches have the expected sizes on that device."""
    x, y = torch.empty(10, 3, device="meta"), torch.empty(10, 1, device="meta")
    ctx = _ctx(_net(), x, y, ClientOptimizer(batch_size=4))
    got = list(ctx.batches())
    assert [tuple(b.shape) for b, _ in got] == [(4, 3), (4, 3), (2, 3)]
    assert all(b.device.type == "meta" and t.device.type == "meta" for b, t in got)


Params = dict[str, Tensor]


HEAD = ["head.weight", "head.bias"]


def client(net: nn.Module, x: Tensor, y: Tensor, batch_size: int = 10, channels_last: bool = False) -> ClientContext:
    opt = ClientOptimizer(lr=0.01, momentum=0.5, batch_size=batch_size)
    gen = torch.Generator().manual_seed(0)
    return client_context(net, x, y, optimizer=opt, loss=loss_fn_for(3), generator=gen, channels_last=channels_last)


def ones_gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
    return {n: torch.ones_like(p[n]) for n in HEAD}, p["head.bias"].sum() * 0


def linear_client(n: int = 4, batch_size: int = 10) -> tuple[ClientContext, Params]:
    g = torch.Generator().manual_seed(1)
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    ctx = client(net, torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g), batch_size)
    return ctx, {k: v.detach().clone() for k, v in net.named_parameters()}


def test_the_phases_learning_rate_replaces_the_rounds() -> None:
    ctx, params = linear_client()
    out = ctx.sgd(params, HEAD, 1, lr=0.5, gradient=ones_gradient)
    for n in params:
        assert_close_finite(out[n], params[n] - 0.5, rtol=1e-6, atol=1e-7)


def test_a_custom_step_direction_gets_the_penalty_gradient_added() -> None:
    ctx, params = linear_client()
    pen = Penalty(lambda p, d: 0.5 * (p["head.weight"] ** 2).sum() * d["c"], {"c": torch.tensor(2.0)})
    out = ctx.sgd(params, HEAD, 1, pen, gradient=ones_gradient)
    want = params["head.weight"] - 0.01 * (1 + 2.0 * params["head.weight"])
    assert_close_finite(out["head.weight"], want, rtol=1e-6, atol=1e-7)
    assert_close_finite(out["head.bias"], params["head.bias"] - 0.01, rtol=1e-6, atol=1e-7)


def test_the_phases_batch_size_sets_the_steps() -> None:
    ctx, params = linear_client(n=4, batch_size=10)
    ctx.sgd(params, HEAD, 1, batch_size=2)
    assert int(ctx.steps_taken) == 2  # 4 samples in batches of 2 (the optimiser's 10 would give 1)


def test_batches_smaller_than_min_batch_are_skipped() -> None:
    ctx, params = linear_client(n=5)
    ctx.sgd(params, HEAD, 1, batch_size=2, min_batch=2)
    assert int(ctx.steps_taken) == 2  # batches of 2, 2 and 1: the last is skipped


def test_channels_last_batches_and_weights() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 3, 4, 4, generator=g)
    net = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    ctx = client(net, x, torch.randint(0, 3, (3,), generator=g), channels_last=True)
    batch, labels = next(iter(ctx.batches()))
    assert batch.is_contiguous(memory_format=torch.channels_last) and not batch.is_contiguous()
    assert_close_finite(batch, x[torch.randperm(3, generator=torch.Generator().manual_seed(0))], rtol=0, atol=0)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    out = ctx.sgd(params, ["2.weight", "2.bias"], 0)  # nothing trained: the copies as the context keeps them
    assert out["0.weight"].is_contiguous(memory_format=torch.channels_last) and not out["0.weight"].is_contiguous()
    assert_close_finite(out["0.weight"], params["0.weight"], rtol=0, atol=0)


def test_channels_last_leaves_flat_batches_alone() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, generator=g)
    ctx = client(nn.Linear(4, 3), x, torch.zeros(4, dtype=torch.long), channels_last=True)
    batch, _ = next(iter(ctx.batches()))
    assert batch.shape == (4, 4)
    assert_close_finite(batch, x[torch.randperm(4, generator=torch.Generator().manual_seed(0))], rtol=0, atol=0)


class FakeTensor:
    """Records how ``to_device`` moves a tensor to an accelerator (no CUDA needed)."""

    def __init__(self) -> None:
        self.moves: list[tuple[tuple, dict]] = []
        self.pinned = False

    def pin_memory(self) -> FakeTensor:
        self.pinned = True
        return self

    def to(self, *args: object, **kwargs: object) -> FakeTensor:
        self.moves.append((args, kwargs))
        return self


def test_the_task_loss_is_cross_entropy_or_half_the_mean_squared_error() -> None:
    """Classification: cross-entropy; regression: ½·MSE (spec 000 eq. 5), here against numpy."""
    out = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 0.5]], dtype=torch.float64)
    y = torch.tensor([[0.5, 2.0], [1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    assert_close_finite(loss_fn_for(None)(out, y), 0.5 * np.mean((out.numpy() - y.numpy()) ** 2), rtol=1e-12, atol=0)
    assert loss_fn_for(2) is F.cross_entropy


def test_per_sample_loss_is_each_samples_task_loss() -> None:
    """``ClientContext.per_sample_loss``: cross-entropy per sample, or the context's regression loss (½·MSE) of
    each sample alone; their mean is the batch loss. Against by-hand formulas."""
    g = torch.Generator().manual_seed(7)
    out, labels, targets = torch.randn(4, 3, generator=g), torch.tensor([0, 2, 1, 2]), torch.randn(4, 3, generator=g)
    x = torch.zeros(4, 3)
    classification = client_context(nn.Linear(3, 3), x, labels, loss=loss_fn_for(3))
    by_hand = -torch.log_softmax(out, 1)[torch.arange(4), labels]
    assert_close_finite(classification.per_sample_loss(out, labels), by_hand)
    regression = client_context(nn.Linear(3, 3), x, targets, loss=loss_fn_for(None))
    by_hand = 0.5 * ((out - targets) ** 2).mean(1)
    assert_close_finite(regression.per_sample_loss(out, targets), by_hand)
    assert_close_finite(regression.per_sample_loss(out, targets).mean(), loss_fn_for(None)(out, targets))


def test_class_sum_step_adds_weighted_rows_by_class_in_the_sums_dtype() -> None:
    """``class_sum_step``: each row of ``values`` times its weight added to its class's sum, the weight to its
    count (weights 1 when none are given), float32 values and weights into float64 sums; against numpy."""
    sums = (torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    values, y = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), torch.tensor([2, 0, 2])
    w = torch.tensor([2.0, 0.5, 1.0])
    class_sum_step(sums, values, y, w)
    class_sum_step(sums, values[:1], y[:1])
    v, labels, weights = values.double().numpy(), y.numpy(), np.array([2.0, 0.5, 1.0, 1.0])
    rows, row_labels = np.concatenate([v, v[:1]]), np.concatenate([labels, labels[:1]])
    expected = np.stack([(rows * weights[:, None])[row_labels == c].sum(0) for c in range(3)])
    assert_close_finite(sums[0], expected, rtol=1e-12, atol=0)
    assert sums[1].tolist() == [0.5, 0.0, 4.0]


def test_functional_batchnorm_chains_a_steps_passes_and_skips_layers_without_statistics() -> None:
    """``FunctionalBatchNorm`` on a layer without running statistics then a tracking one (float64): nothing is new
    before a step; two forward passes of one step chain their updates as torch's BatchNorm does in place (the
    second pass starts from the first's statistics); the untracked layer is skipped, not the end of the list; a
    counter comes back only when the parameters have one."""
    net = nn.Sequential(nn.BatchNorm1d(3, track_running_stats=False), nn.BatchNorm1d(3)).double().train()
    g = torch.Generator().manual_seed(2)
    x1, x2 = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    ref = copy.deepcopy(net)
    ref(x1), ref(x2)  # torch's in-place updates
    params = {n: t.detach().clone() for n, t in {**dict(net.named_parameters()), **dict(net.named_buffers())}.items()}
    batchnorm = FunctionalBatchNorm(net)
    assert batchnorm.updates(params) == {}
    with batchnorm:
        batchnorm.begin(torch.ones(5))
        torch.func.functional_call(net, params, (x1,))
        with batchnorm.rows(torch.ones(4)):
            torch.func.functional_call(net, params, (x2,))
        new = batchnorm.updates(params)
        without_counter = batchnorm.updates({n: v for n, v in params.items() if n != "1.num_batches_tracked"})
    assert sorted(new) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    for n, v in new.items():
        assert_close_finite(v, dict(ref.named_buffers())[n], rtol=1e-12, atol=1e-12, msg=n)
    assert sorted(without_counter) == ["1.running_mean", "1.running_var"]


def test_functional_batchnorm_of_one_channel_with_a_cumulative_average_equals_torch() -> None:
    """One channel and ``momentum=None`` (the running statistics are the cumulative average, factor
    1/num_batches_tracked), float64: two passes give torch's in-place statistics to 1e-12; installed but before a
    step begins, the layer is torch's own BatchNorm."""
    net = nn.Sequential(nn.BatchNorm1d(1, momentum=None)).double().train()
    net[0].num_batches_tracked.fill_(2)  # factors 1/3 and 1/4: 1/3 is not exact in float32
    g = torch.Generator().manual_seed(3)
    x1, x2 = torch.randn(5, 1, generator=g, dtype=torch.float64), torch.randn(3, 1, generator=g, dtype=torch.float64)
    ref = copy.deepcopy(net)
    first = ref(x1)
    ref(x2)
    params = {n: t.detach().clone() for n, t in {**dict(net.named_parameters()), **dict(net.named_buffers())}.items()}
    batchnorm = FunctionalBatchNorm(net)
    with batchnorm:
        plain = {n: v.clone() for n, v in params.items()}
        assert_close_finite(torch.func.functional_call(net, plain, (x1,)), first, rtol=1e-12, atol=1e-12)
        batchnorm.begin(torch.ones(5))
        torch.func.functional_call(net, params, (x1,))
        with batchnorm.rows(torch.ones(3)):
            torch.func.functional_call(net, params, (x2,))
        new = batchnorm.updates(params)
    for n, v in new.items():
        assert_close_finite(v, dict(ref.named_buffers())[n], rtol=1e-12, atol=1e-12, msg=n)


def test_add_gradient_adds_to_the_named_leaves_and_starts_those_without_one() -> None:
    """``add_gradient``: names that are not leaves are skipped (not the end of the list), a leaf with a gradient
    gets the sum, a leaf without one gets a copy."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    a.grad = torch.ones(2)
    grads = {"x": torch.full((2,), 5.0), "a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0, 4.0])}
    add_gradient({"a": a, "b": b}, grads)
    assert a.grad.tolist() == [2.0, 3.0] and b.grad.tolist() == [3.0, 4.0]
    assert b.grad is not grads["b"]


def test_to_device_moves_to_the_device_it_is_given() -> None:
    """To CUDA through pinned memory without blocking, to another device (``meta``) by a plain ``to``; both to the
    device given (no CUDA needed: ``FakeTensor`` records the calls)."""
    for kind in ("cuda", "meta"):
        t, device = FakeTensor(), torch.device(kind, 0) if kind == "cuda" else torch.device(kind)
        assert to_device(t, device) is t
        assert t.pinned == (kind == "cuda")
        assert t.moves == [((device,), {"non_blocking": True} if kind == "cuda" else {})]


def test_steps_per_epoch_and_step_limit_default_to_stepping_on_every_batch() -> None:
    """Without ``min_batch`` a last batch of one sample is a step: ⌈11 / 5⌉ = 3 per epoch, and a half-budget
    straggler over 2 epochs gets ⌊0.5 · 2 · 3⌋ = 3 steps."""
    assert steps_per_epoch(11, 5) == 3
    assert steps_per_epoch(11, 5, min_batch=2) == 2
    assert step_limit(0.5, 2, 11, 5, None) == 3


class _NotedSGD(torch.optim.SGD):
    """SGD whose per-parameter state also holds a non-tensor note, stored before the momentum buffer."""

    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("note", "not a tensor")
        return super().step(closure)


def test_state_template_skips_non_tensor_state_and_keeps_what_follows() -> None:
    """Entries of the optimiser state that are not tensors are left out of the kept state; the tensor entries after
    them are kept (momentum buffer shaped like the parameter)."""
    template = state_template(ClientOptimizer(factory=functools.partial(_NotedSGD, lr=0.1, momentum=0.9)),
                              {"w": torch.zeros(4, 5)})
    assert sorted(template) == [state_name("momentum_buffer", "w"), state_name("steps", "w")]
    assert template[state_name("momentum_buffer", "w")].shape == (4, 5)


def test_state_template_lives_on_the_parameters_device() -> None:
    """The counters and the state of parameters on another device (``meta`` here) are made on that device."""
    adam = ClientOptimizer.from_config(functools.partial(torch.optim.Adam, lr=0.1))
    template = state_template(adam, {"w": torch.zeros(4, 5, device="meta")})
    assert sorted(template) == sorted(state_name(k, "w") for k in ("steps", "step", "exp_avg", "exp_avg_sq"))
    assert {v.device.type for v in template.values()} == {"meta"}


def test_state_keys_of_nested_parameter_names() -> None:
    """The state key is the first dotted piece after the prefix, whatever dots the parameter's name has."""
    params = {"body.fc.weight": torch.zeros(2), "head.bias": torch.zeros(2)}
    kept = state_template(ClientOptimizer(momentum=0.9), params)
    assert state_keys(kept) == ["momentum_buffer"]


def test_load_state_gives_the_state_to_a_stepped_leaf_after_a_fresh_one() -> None:
    """A fresh leaf (kept counter 0) starts fresh; a leaf after it that has stepped still gets its kept state."""
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1)
    kept = {**_kept("a", 0, 0.0, torch.zeros(3)), **_kept("b", 5, 5.0, torch.tensor([1.0, -1.0, 2.0]))}
    load_state(opt, {"a": a, "b": b}, kept)
    assert a not in opt.state or not opt.state[a]
    assert float(opt.state[b]["step"]) == 5.0
    assert_close_finite(opt.state[b]["exp_avg"], torch.tensor([1.0, -1.0, 2.0]))


class _MLP(nn.Sequential):
    """Linear, ReLU, Linear with the engine's forward signature (``side`` information, unused)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


def test_a_fresh_context_lists_its_trainable_names_and_scores_a_batch() -> None:
    """``param_names``: the trainable parameters in the network's order (a frozen one left out), which
    ``params_with`` / ``params_without`` split; no class sums before a phase; ``batch_loss`` outside a ``Gradient``
    is the plain cross-entropy of the batch."""
    net = _MLP()
    net[0].bias.requires_grad_(False)
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 1, 1, 0, 1])
    ctx = client_context(net, x, y, loss=F.cross_entropy)
    assert ctx.param_names == ["0.weight", "2.weight", "2.bias"]
    assert ctx.params_with(["2."]) == ["2.weight", "2.bias"]
    assert ctx.params_without(["2."]) == ["0.weight"]
    assert ctx.class_sums_seen is None
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    hidden = torch.relu(x @ params["0.weight"].T + params["0.bias"])
    logits = hidden @ params["2.weight"].T + params["2.bias"]
    expected = -torch.log_softmax(logits, 1)[torch.arange(5), y].mean()
    assert_close_finite(ctx.batch_loss(params, x, y), expected)


def _bn1d_phases(batchnorm: bool, samples: int, drop_last: bool, phases: int) -> tuple[int, list[str]]:
    """(steps of the last phase, warnings logged) of ``phases`` one-epoch phases of an MLP with (or without) a
    ``BatchNorm1d`` on ``samples`` samples in batches of 4."""
    net = _MLP()
    net[1] = nn.BatchNorm1d(4) if batchnorm else nn.ReLU()
    x = torch.randn(samples, 3, generator=torch.Generator().manual_seed(1))
    y = torch.arange(samples) % 2
    ctx = client_context(net, x, y, loss=F.cross_entropy, optimizer=ClientOptimizer(batch_size=4, drop_last=drop_last))
    params = {n: t.detach().clone() for n, t in {**dict(net.named_parameters()), **dict(net.named_buffers())}.items()}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("fl_lightning")
    logger.addHandler(handler)
    try:
        for _ in range(phases):
            ctx.sgd(params, ctx.param_names, epochs=1)
    finally:
        logger.removeHandler(handler)
    return int(ctx.steps_taken), records


def test_a_batchnorm1d_client_skips_a_last_batch_of_one_and_leaves_saying_so_to_the_run() -> None:
    """Batches of 4: a BatchNorm1d client of 5 samples takes 1 step (the last batch, 1 sample, is skipped), and so
    with ``drop_last`` (asked for); the context says nothing: the run says it once, on every path
    (``executor.decide``, tests/engine/test_executor.py)."""
    assert _bn1d_phases(True, 5, False, 1) == (1, [])
    assert _bn1d_phases(True, 9, False, 2) == (2, [])
    assert _bn1d_phases(True, 5, True, 1) == (1, [])


@pytest.mark.parametrize(("batchnorm", "samples", "steps"), [(True, 8, 2), (True, 10, 3), (False, 9, 3)])
def test_no_batch_of_one_or_no_batchnorm1d_says_nothing(batchnorm: bool, samples: int, steps: int) -> None:
    """8 or 10 samples in batches of 4 (no batch of one) or no BatchNorm1d: every batch steps, nothing is said."""
    assert _bn1d_phases(batchnorm, samples, False, 1) == (steps, [])
