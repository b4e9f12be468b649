"""``ClientContext`` and the helpers of ``fl_lightning.client`` against plain-torch references.

Each reference is written out here: the epoch's shuffle (``randperm`` on a generator seeded like the client's) and
the augmentation draws, then minibatch momentum SGD by hand (``buf = m·buf + g + wd·p``, ``p −= lr·buf``) with the
gradient from ``torch.autograd`` on the reference's own tensors. Settings from ``ClientOptimizer.from_config``
are checked against the optimiser class's own defaults or the init args the test gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.client import (
    ClientContext,
    ClientOptimizer,
    Objective,
    draws_ahead,
    epoch_draws,
    state_name,
    state_template,
    step_limit,
    to_device,
)
from fl_lightning.errors import ConfigError

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
    return ClientContext(net, 0, x, y, None, opt, F.mse_loss, _gen(), **kw)


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
        ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(lr=0.1, batch_size=4), F.cross_entropy, _gen(),
                            channels_last=cl)  # fmt: skip
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
    ctx = ClientContext(net, 0, x, y, side, ClientOptimizer(), F.mse_loss, _gen())
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
    assert ClientContext(net, 0, x, y, None, ClientOptimizer(), F.mse_loss, _gen()).side_for(3) is None


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


def test_build_lr_argument_sets_every_group() -> None:
    """``build(params, lr)`` puts ``lr`` in every group (also with a factory and a bias group); without it the
    round's ``self.lr``."""
    w, b = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)
    for factory in (None, functools.partial(torch.optim.Adam, lr=0.5)):
        opt = ClientOptimizer(lr=0.2, decay_bias=False, factory=factory)
        assert [g["lr"] for g in opt.build({"a.weight": w, "a.bias": b}, 0.07).param_groups] == [0.07, 0.07]
        assert [g["lr"] for g in opt.build({"a.weight": w, "a.bias": b}).param_groups] == [0.2, 0.2]


def test_from_config_without_a_factory_keeps_the_given_settings() -> None:
    """No factory: the given settings, and the spec defaults (lr 0.01, momentum 0.5, no decay, batch 10)."""
    assert ClientOptimizer.from_config(None) == ClientOptimizer(0.01, 0.5, 0.0, 10, True, None)
    got = ClientOptimizer.from_config(None, 0.2, 0.8, 0.1, 7, False)
    assert (got.lr, got.momentum, got.weight_decay, got.batch_size, got.decay_bias, got.factory) == (
        0.2, 0.8, 0.1, 7, False, None)  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (functools.partial(torch.optim.SGD, lr=0.3, momentum=0.9, weight_decay=0.1), (0.3, 0.9, 0.1)),
        (functools.partial(torch.optim.Adam, lr=0.002), (0.002, 0.0, 0.0)),
        (functools.partial(torch.optim.Rprop, lr=0.04), (0.04, 0.0, 0.0)),
    ],
)
def test_from_config_with_a_factory_reads_its_init_args(factory: Callable, expected: tuple) -> None:
    """With a factory, lr / momentum / weight decay are the optimiser's own (0 where it has none); batch size and
    ``decay_bias`` are the given ones; the factory is kept."""
    got = ClientOptimizer.from_config(factory, lr=0.01, momentum=0.5, weight_decay=0.3, batch_size=7, decay_bias=False)
    assert (got.lr, got.momentum, got.weight_decay) == pytest.approx(expected)
    assert (got.batch_size, got.decay_bias, got.factory) == (7, False, factory)


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
