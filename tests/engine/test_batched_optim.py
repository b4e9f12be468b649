"""``fl_lightning/engine/batched_optim.py``: the client optimisers written out for stacked clients (``BatchedSGD``,
``BatchedAdam``, ``batched_rule``), step by step against each client's own ``torch.optim`` optimiser."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import Tensor

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.batched_optim import BatchedAdam, BatchedSGD, batched_rule
from tests.helpers.asserts import assert_close_finite

SGD_HYPER = {"weight_decay": 0.0, "momentum": 0, "dampening": 0, "nesterov": False, "maximize": False}


def test_a_differentiable_optimizer_has_no_batched_form() -> None:
    """``defaults["differentiable"]`` (the probe cannot step such an optimiser, so it is handed over unstepped)."""
    for differentiable, expected in ((True, type(None)), (False, BatchedSGD)):
        settings = ClientOptimizer(factory=functools.partial(torch.optim.SGD, lr=0.01))
        probe = torch.optim.SGD([torch.zeros(2, 3, requires_grad=True)], lr=0.01, differentiable=differentiable)
        object.__setattr__(settings, "probe", lambda probe=probe: probe)
        assert isinstance(batched_rule(settings), expected)


def test_adamw_is_decoupled_without_the_defaults_key() -> None:
    """Older torch (< 2.6) has no ``decoupled_weight_decay`` in ``defaults``: the class alone decides (both classes
    in one test: each runs under ``make mutation``'s per-function test cap)."""
    for cls, decoupled in ((torch.optim.AdamW, True), (torch.optim.Adam, False)):
        settings = ClientOptimizer(factory=functools.partial(cls, lr=0.01))
        probe = settings.probe()
        probe.defaults.pop("decoupled_weight_decay", None)
        object.__setattr__(settings, "probe", lambda probe=probe: probe)
        rule = batched_rule(settings)
        assert isinstance(rule, BatchedAdam)
        assert rule.decoupled is decoupled, cls


def test_sgd_without_momentum_keeps_no_state() -> None:
    rule = BatchedSGD(SGD_HYPER)
    assert rule.keys == ()
    assert rule.init(torch.zeros(3, 2)) == {}
    with_momentum = BatchedSGD({**SGD_HYPER, "momentum": 0.5})
    assert with_momentum.keys == ("momentum_buffer",)
    assert set(with_momentum.init(torch.zeros(3, 2))) == {"momentum_buffer"}


@pytest.mark.parametrize("decoupled", [False, True])
def test_batched_adam_state_is_zero_per_client_and_on_the_parameters_device(decoupled: bool) -> None:
    rule = BatchedAdam(HYPER, decoupled)
    on_meta = rule.init(torch.empty(3, 4, 5, device="meta"))
    assert set(on_meta) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert all(t.device.type == "meta" for t in on_meta.values())
    on_cpu = rule.init(torch.randn(3, 4, 5))
    assert on_cpu["step"].shape == (3,) and not on_cpu["step"].any()  # one step count per client, all at 0
    assert all(t.shape == (3, 4, 5) and not t.any() for k, t in on_cpu.items() if k != "step")




HYPER = {"weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": True, "maximize": False}


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


def _steps_each_client_as_its_torch_optimizer(name: str) -> None:
    """The stacked optimiser rule ``RULES[name]``, with client k joining at step k (masked as the executor masks),
    gives each client what its own ``torch.optim`` optimiser gives after its own steps (float64, 1e-12)."""
    from fl_lightning.engine.batched_optim import batched_rule

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
        assert_close_finite(p[k], leaf.detach(), rtol=1e-12, atol=1e-12, msg=f"{name}: client {k}")
    assert not torch.equal(p[0], start[0]), name


# a few rules per test, every case in it: each case runs under ``make mutation``'s per-function test cap (the
# fastest tests that call a function), which sees one case of a parametrized test
def test_batched_sgd_steps_each_client_as_torch_sgd() -> None:
    for name in ("sgd_plain", "sgd_maximize_wd"):
        _steps_each_client_as_its_torch_optimizer(name)


def test_batched_sgd_with_momentum_maximizing_steps_each_client_as_torch_sgd() -> None:
    _steps_each_client_as_its_torch_optimizer("sgd_momentum_maximize")


def test_batched_sgd_with_dampening_or_nesterov_steps_each_client_as_torch_sgd() -> None:
    for name in ("sgd_dampening", "sgd_nesterov"):
        _steps_each_client_as_its_torch_optimizer(name)


def test_batched_adam_steps_each_client_as_torch_adam() -> None:
    for name in RULES:
        if name.startswith("adam"):
            _steps_each_client_as_its_torch_optimizer(name)


def test_step_all_steps_every_parameter_as_its_own_torch_sgd() -> None:
    """``step_all`` over a list of parameters (the foreach form: plain SGD, momentum, one weight decay; and the
    per-parameter form: decays that differ, dampening, Nesterov) gives each client's parameter what its own
    ``torch.optim.SGD`` gives it over the same steps (float64, 1e-12)."""
    shapes = [(4, 3), (3,), (2, 2, 2)]
    cases = [
        (dict(lr=0.1), [0.0, 0.0, 0.0]),
        (dict(lr=0.1, momentum=0.9), [0.0, 0.0, 0.0]),
        (dict(lr=0.05, momentum=0.5), [0.02, 0.02, 0.02]),
        (dict(lr=0.05), [0.03, 0.03, 0.03]),
        (dict(lr=0.05, momentum=0.5), [0.02, 0.0, 0.02]),
        (dict(lr=0.05, momentum=0.5, dampening=0.3), [0.0, 0.0, 0.0]),
        (dict(lr=0.05, momentum=0.5, nesterov=True), [0.01, 0.01, 0.01]),
    ]
    g = torch.Generator().manual_seed(5)
    k_clients, steps = 3, 4
    for hyper, decays in cases:
        rule = BatchedSGD({**SGD_HYPER, **hyper})
        start = [torch.randn(k_clients, *s, generator=g, dtype=torch.float64) for s in shapes]
        grads = [[torch.randn(k_clients, *s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(steps)]
        ps, states = list(start), [rule.init(p) for p in start]
        counts = [torch.zeros(k_clients, dtype=torch.long) for _ in shapes]
        for t in range(steps):
            stepped = rule.step_all(ps, grads[t], states, [c + t for c in counts], hyper["lr"], decays)
            assert len(stepped) == len(shapes)
            ps, states = [p for p, _ in stepped], [s for _, s in stepped]
        for i in range(len(shapes)):
            for k in range(k_clients):
                leaf = start[i][k].clone().requires_grad_(True)
                opt = torch.optim.SGD([leaf], **{**hyper, "weight_decay": decays[i]})
                for t in range(steps):
                    leaf.grad = grads[t][i][k].clone()
                    opt.step()
                assert_close_finite(ps[i][k], leaf.detach(), rtol=1e-12, atol=1e-12, msg=f"{hyper} {decays} {i} {k}")
        assert all(not torch.equal(p, s) for p, s in zip(ps, start))


def _sgd_reference(start: Tensor, grads: list[Tensor], hyper: dict, decay: float) -> Tensor:
    """Each client's parameter after ``torch.optim.SGD``'s steps with the given gradients, client by client."""
    out = []
    for k in range(start.shape[0]):
        leaf = start[k].clone().requires_grad_(True)
        opt = torch.optim.SGD([leaf], **{**hyper, "weight_decay": decay})
        for g in grads:
            leaf.grad = g[k].clone()
            opt.step()
        out.append(leaf.detach())
    return torch.stack(out)


def test_step_all_maximizing_or_of_one_parameter_steps_as_torch_sgd() -> None:
    """``step_all`` with ``maximize`` (with and without momentum, with one weight decay) ascends as
    ``torch.optim.SGD(maximize=True)`` does, and a step of a single parameter (a bias-free one-layer network) with
    weight decay and momentum is torch's (float64, 1e-12)."""
    g = torch.Generator().manual_seed(12)
    cases = [
        (dict(lr=0.1, maximize=True), [(4, 3), (3,)], [0.0, 0.0]),
        (dict(lr=0.05, momentum=0.5, maximize=True), [(4, 3), (3,)], [0.02, 0.02]),
        (dict(lr=0.05, momentum=0.5), [(4, 3)], [0.03]),
        (dict(lr=0.05), [(2, 2)], [0.03]),
    ]
    k_clients, steps = 3, 3
    for hyper, shapes, decays in cases:
        rule = BatchedSGD({**SGD_HYPER, **hyper})
        start = [torch.randn(k_clients, *s, generator=g, dtype=torch.float64) for s in shapes]
        grads = [[torch.randn(k_clients, *s, generator=g, dtype=torch.float64) for s in shapes] for _ in range(steps)]
        ps, states = list(start), [rule.init(p) for p in start]
        for t in range(steps):
            counts = [torch.full((k_clients,), t, dtype=torch.long) for _ in shapes]
            stepped = rule.step_all(ps, grads[t], states, counts, hyper["lr"], decays)
            ps, states = [p for p, _ in stepped], [s for _, s in stepped]
        for i in range(len(shapes)):
            want = _sgd_reference(start[i], [grads[t][i] for t in range(steps)], hyper, decays[i])
            assert_close_finite(ps[i], want, rtol=1e-12, atol=1e-12, msg=f"{hyper} {decays} {i}")


def test_step_all_takes_the_foreach_form_exactly_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain SGD, momentum and one weight decay for every parameter never call the per-parameter ``step``;
    dampening, Nesterov, maximize or decays that differ go through it, once per parameter."""
    calls: list[int] = []
    real_step = BatchedSGD.step

    def counted(self: BatchedSGD, *args: object) -> tuple:
        calls.append(1)
        return real_step(self, *args)

    monkeypatch.setattr(BatchedSGD, "step", counted)
    ps = [torch.ones(2, 3), torch.ones(2)]
    gs = [torch.full((2, 3), 0.5), torch.full((2,), 0.5)]
    counts = [torch.zeros(2, dtype=torch.long)] * 2
    for hyper, decays, per_parameter in [
        (dict(), [0.0, 0.0], False),
        (dict(momentum=0.9), [0.1, 0.1], False),
        (dict(), [0.1, 0.0], True),
        (dict(momentum=0.9, dampening=0.5), [0.0, 0.0], True),
        (dict(momentum=0.9, nesterov=True), [0.0, 0.0], True),
        (dict(maximize=True), [0.0, 0.0], True),
    ]:
        rule = BatchedSGD({**SGD_HYPER, **hyper})
        calls.clear()
        rule.step_all(ps, gs, [rule.init(p) for p in ps], counts, 0.1, decays)
        assert len(calls) == (2 if per_parameter else 0), hyper


def test_step_all_of_a_single_parameter_with_weight_decay_by_hand() -> None:
    """One parameter (a bias-free one-layer network), weight decay λ and momentum μ, two steps written out:
    d = g + λθ, b₁ = d₁, b₂ = μb₁ + d₂, θ ← θ − ηb."""
    rule = BatchedSGD({**SGD_HYPER, "momentum": 0.5})
    p0 = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    g1, g2 = torch.full_like(p0, 0.25), torch.tensor([[1.0, 0.0], [-1.0, 2.0]], dtype=torch.float64)
    count = [torch.zeros(2, dtype=torch.long)]
    ((p1, s1),) = rule.step_all([p0], [g1], [rule.init(p0)], count, 0.1, [0.2])
    ((p2, _),) = rule.step_all([p1], [g2], [s1], count, 0.1, [0.2])
    b1 = g1 + 0.2 * p0
    want1 = p0 - 0.1 * b1
    want2 = want1 - 0.1 * (0.5 * b1 + g2 + 0.2 * want1)
    assert_close_finite(p1, want1, rtol=1e-14, atol=1e-15)
    assert_close_finite(p2, want2, rtol=1e-14, atol=1e-15)


def test_step_all_without_weight_decay_leaves_an_overflowed_parameter_as_torch_sgd_does() -> None:
    """Without weight decay torch adds no λθ term, so an infinite entry stays infinite (0·∞ would be NaN) and every
    other entry steps as usual."""
    rule = BatchedSGD(dict(SGD_HYPER))
    p = torch.tensor([[1.0, float("inf")], [2.0, -3.0]], dtype=torch.float64)
    g = torch.tensor([[0.5, 0.25], [1.0, -1.0]], dtype=torch.float64)
    (new, _), = rule.step_all([p], [g], [{}], [torch.zeros(2, dtype=torch.long)], 0.1, [0.0])
    want = _sgd_reference(p, [g], dict(lr=0.1), 0.0)
    assert not new.isnan().any() and torch.equal(new, want)
    assert new[0, 1] == float("inf")


def test_batched_rule_is_none_without_a_batched_form() -> None:
    """Optimisers the executor cannot stack: another class, a tensor learning rate."""
    from fl_lightning.engine.batched_optim import BatchedAdam, BatchedSGD, batched_rule

    def rule(cls: type, **hyper: object):
        return batched_rule(ClientOptimizer(factory=functools.partial(cls, **hyper)))

    assert rule(torch.optim.RMSprop, lr=0.01) is None
    assert rule(torch.optim.Adam, lr=torch.tensor(0.01)) is None
    assert isinstance(rule(torch.optim.SGD, lr=0.01), BatchedSGD)
    assert isinstance(rule(torch.optim.Adam, lr=0.01), BatchedAdam) and not rule(torch.optim.Adam, lr=0.01).decoupled
    assert rule(torch.optim.AdamW, lr=0.01).decoupled
    assert rule(torch.optim.Adam, lr=0.01, decoupled_weight_decay=True).decoupled
    assert isinstance(batched_rule(ClientOptimizer()), BatchedSGD)


def test_batched_rule_probes_each_setting_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor asks every round: the probe optimiser is built once per settings, and an unhashable factory
    is probed every time (same answers)."""
    from fl_lightning.engine import batched_optim

    probes: list[ClientOptimizer] = []
    original = ClientOptimizer.probe

    def probe(self: ClientOptimizer) -> torch.optim.Optimizer:
        probes.append(self)
        return original(self)

    monkeypatch.setattr(ClientOptimizer, "probe", probe)
    monkeypatch.setattr(batched_optim, "_RULES", {})
    sgd, other_lr = ClientOptimizer(momentum=0.9), ClientOptimizer(momentum=0.9, lr=0.5)
    first = batched_optim.batched_rule(sgd)
    assert batched_optim.batched_rule(ClientOptimizer(momentum=0.9)) is first and first.momentum == 0.9
    assert batched_optim.batched_rule(other_lr).momentum == 0.9 and len(probes) == 2

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, groups: list) -> torch.optim.Optimizer:
            return torch.optim.RMSprop(groups, lr=0.01)

    odd = ClientOptimizer(factory=Unhashable())
    assert batched_optim.batched_rule(odd) is None and batched_optim.batched_rule(odd) is None
    assert len(probes) == 4


@pytest.mark.parametrize(("cls", "amsgrad"), [(torch.optim.Adam, False), (torch.optim.Adam, True),
                                               (torch.optim.AdamW, False)])
def test_batched_adam_keeps_the_state_keys_torch_keeps(cls: type, amsgrad: bool) -> None:
    """The kept client optimiser state is named by torch's own state keys (``max_exp_avg_sq`` only with amsgrad)."""
    rule = batched_rule(ClientOptimizer.from_config(functools.partial(cls, lr=0.01, amsgrad=amsgrad)))
    leaf = torch.zeros(2, requires_grad=True)
    opt = cls([leaf], lr=0.01, amsgrad=amsgrad)
    leaf.grad = torch.ones(2)
    opt.step()
    assert isinstance(rule, BatchedAdam)
    assert sorted(rule.keys) == sorted(opt.state[leaf])
    assert sorted(rule.init(torch.zeros(3, 2))) == sorted(opt.state[leaf])


def test_batched_adam_steps_float32_parameters_in_float32() -> None:
    """The bias corrections are computed in float64 from the step counts and cast to the parameters' dtype: float32
    clients stay float32 and match ``torch.optim.Adam``."""
    hyper = {"lr": 0.01, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False, "maximize": False}
    rule = BatchedAdam(hyper, decoupled=False)
    g = torch.Generator().manual_seed(4)
    start, grads = torch.randn(2, 3, generator=g), torch.randn(3, 2, 3, generator=g)
    p, state, count = start.clone(), rule.init(start), torch.zeros(2, dtype=torch.long)
    for t in range(3):
        p, state = rule.step(p, grads[t], state, count, 0.01, 0.0)
        count = count + 1
    assert p.dtype == torch.float32
    for k in range(2):
        leaf = start[k].clone().requires_grad_(True)
        opt = torch.optim.Adam([leaf], lr=0.01)
        for t in range(3):
            leaf.grad = grads[t, k].clone()
            opt.step()
        assert_close_finite(p[k], leaf.detach(), rtol=1e-6, atol=1e-7)
