"""``VectorizedContext.sgd`` and ``plan_phase`` against plain-torch references written here.

Every client's batch is its whole data set (batch size 10 ≥ its samples), so an epoch is one full-batch step whatever
the shuffle, and the reference is ``torch.optim.SGD`` on the client's full-batch loss. ``meta`` stands in for an
accelerator where the device of what a phase builds is checked."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.func import grad_and_value
from torch.nn import functional as F

import fl_lightning.engine.stacked as executors
from fl_lightning.client import ClientOptimizer, Penalty
from fl_lightning.engine.stacked import VectorizedContext, per_sample_loss_for, plan_phase, stack
from fl_lightning.models.split import Concat, SplitModel

LR = 0.1
Params = dict[str, Tensor]


def data(sizes: tuple[int, ...] = (4, 3), dim: int = 4, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, dim, generator=g) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in sizes]
    return xs, ys


def context(
    net: nn.Module,
    xs: list[Tensor],
    ys: list[Tensor],
    optimizer: ClientOptimizer | None = None,
    sides: list[Tensor] | None = None,
    augment: object = None,
    num_classes: int | None = 3,
    **kwargs: object,
) -> VectorizedContext:
    optimizer = ClientOptimizer(lr=LR, batch_size=10) if optimizer is None else optimizer
    k = len(xs)
    gens = [torch.Generator().manual_seed(5 + i) for i in range(k)]
    return VectorizedContext(net, range(k), xs, ys, sides, optimizer, per_sample_loss_for(num_classes), gens,
                             augment, 0, 0, [1.0] * k, **kwargs)  # fmt: skip


def stacked_params(net: nn.Module, k: int, seed: int = 1) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(k, *p.shape, generator=g) * 0.5 for n, p in net.named_parameters()}


def reference(
    loss_of: Callable[[Params], Tensor], params: Params, trainable: list[str], steps: int, lr: float = LR
) -> Params:
    """``steps`` full-batch steps of torch's momentum SGD (momentum 0.5) on ``loss_of``."""
    leaves = {n: v.clone().requires_grad_(n in trainable) for n, v in params.items()}
    opt = torch.optim.SGD([leaves[n] for n in trainable], lr=lr, momentum=0.5)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(leaves).backward()
        opt.step()
    return {n: v.detach() for n, v in leaves.items()}


def linear_loss(x: Tensor, y: Tensor) -> Callable[[Params], Tensor]:
    return lambda p: F.cross_entropy(x @ p["weight"].T + p["bias"], y)


def check_clients(got: Params, params: Params, xs: list[Tensor], loss: Callable, trainable: list[str], steps: int):
    for k, (x, y) in enumerate(zip(xs, loss[1])):
        mine = {n: v[k] for n, v in params.items()}
        want = reference(loss[0](x, y, k), mine, trainable, steps)
        for n in params:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")


# ---- penalties, max_steps, step paths --------------------------------------------------------------------------
def test_a_plain_penalty_function_is_added_to_every_clients_loss() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys)
    got = ctx.sgd(params, ["weight", "bias"], 2, penalty=lambda p: 3.0 * (p["weight"] ** 2).sum())

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: linear_loss(x, y)(p) + 3.0 * (p["weight"] ** 2).sum()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 2)


def test_max_steps_stops_every_client() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys)
    got = ctx.sgd(params, ["weight", "bias"], 3, max_steps=1)
    assert ctx.steps_taken.tolist() == [1, 1]
    check_clients(got, params, xs, (lambda x, y, k: linear_loss(x, y), ys), ["weight", "bias"], 1)


def test_linear_networks_step_without_vmap(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_vmap(*args: object, **kwargs: object) -> None:
        raise AssertionError("vmap used")

    monkeypatch.setattr(executors, "vmap", no_vmap)
    xs, ys = data()
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    params = stacked_params(net, 2)
    got = context(net, xs, ys).sgd(params, list(params), 1)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: F.cross_entropy(
            torch.tanh(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"], y
        )

    check_clients(got, params, xs, (loss, ys), list(params), 1)


def test_a_network_with_other_layers_is_vmapped_with_its_penalty() -> None:
    xs, ys = data()
    net = nn.Sequential(nn.Linear(4, 3), nn.Hardtanh())  # Hardtanh: not stackable, so vmapped
    params = stacked_params(net, 2)
    anchor = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(9))
    pen = Penalty(lambda p, d: ((p["0.weight"] - d["a"]) ** 2).sum(), {"a": anchor})
    got = context(net, xs, ys).sgd(params, list(params), 2, penalty=pen)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: (
            F.cross_entropy(F.hardtanh(x @ p["0.weight"].T + p["0.bias"]), y) + ((p["0.weight"] - anchor[k]) ** 2).sum()
        )

    check_clients(got, params, xs, (loss, ys), list(params), 2)


def test_a_trained_name_the_network_does_not_use_stays_as_it_is() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = {**stacked_params(net, 2), "extra": torch.ones(2, 5)}
    got = context(net, xs, ys).sgd(params, ["weight", "bias", "extra"], 1)
    assert_close_finite(got["extra"], torch.ones(2, 5), rtol=0, atol=0)
    base = {n: v for n, v in params.items() if n != "extra"}
    check_clients(got, base, xs, (lambda x, y, k: linear_loss(x, y), ys), ["weight", "bias"], 1)


def test_regression_targets_with_several_outputs() -> None:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g)]
    ys = [torch.randn(4, 2, generator=g), torch.randn(3, 2, generator=g)]
    net = nn.Linear(4, 2)
    params = stacked_params(net, 2)
    got = context(net, xs, ys, num_classes=None).sgd(params, ["weight", "bias"], 1)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: 0.5 * ((x @ p["weight"].T + p["bias"] - y) ** 2).mean()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 1)


def test_float64_clients_keep_their_losses_in_float64() -> None:
    xs, ys = data()
    xs = [x.double() for x in xs]
    net = nn.Linear(4, 3).double()
    params = {n: v.double() for n, v in stacked_params(net, 2).items()}
    ctx = context(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1)
    assert ctx.train_loss.dtype == torch.float64
    for k in range(2):
        want = linear_loss(xs[k], ys[k])({n: v[k] for n, v in params.items()})
        assert_close_finite(ctx.train_loss[k], want, rtol=1e-10, atol=1e-12)


def test_a_float64_penalty_leaves_the_loss_in_the_datas_dtype() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    pen = Penalty(lambda p, d: (p["weight"].double() * d["c"]).sum(), {"c": torch.ones(2, 3, 4, dtype=torch.float64)})
    ctx = context(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1, penalty=pen)
    assert ctx.train_loss.dtype == torch.float32


# ---- phases that do nothing -------------------------------------------------------------------------------------
def test_no_epochs_or_nothing_to_train_leaves_the_last_phase_and_the_generators() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1)
    loss, steps = ctx.train_loss.clone(), ctx.steps_taken.clone()
    assert loss.abs().min() > 0
    states = [g.get_state() for g in ctx.generators]
    for trainable, epochs in ((["weight", "bias"], 0), ([], 1)):
        out = ctx.sgd(params, trainable, epochs)
        assert_close_finite(out["weight"], params["weight"], rtol=0, atol=0)
        assert_close_finite(ctx.train_loss, loss, rtol=0, atol=0)
        assert ctx.steps_taken.tolist() == steps.tolist() == [1, 1]
        assert all(torch.equal(g.get_state(), s) for g, s in zip(ctx.generators, states))


def test_a_phase_without_steps_reports_zero_loss_per_client() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1)
    out = ctx.sgd(params, ["weight", "bias"], 1, max_steps=0)
    assert ctx.train_loss.shape == (2,) and ctx.train_loss.tolist() == [0.0, 0.0]
    assert ctx.steps_taken.tolist() == [0, 0]
    assert_close_finite(out["bias"], params["bias"], rtol=0, atol=0)


def test_what_a_batched_phase_builds_is_on_the_clients_device() -> None:
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(3, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(3, dtype=torch.long, device=meta)]
    net = nn.Linear(4, 3)
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    damped = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.SGD, lr=LR, momentum=0.5,
                                                                      dampening=0.1))  # fmt: skip
    ctx = context(net, xs, ys, optimizer=damped)
    out = ctx.sgd(params, ["weight", "bias"], 2)
    assert out["weight"].device == meta and ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)
    ctx.sgd(params, ["weight", "bias"], 1, max_steps=0)
    assert ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)


# ---- client-by-client paths ------------------------------------------------------------------------------------
def ones_gradient(trainable: list[str]) -> Callable:
    """A custom step direction: all ones (not the loss's gradient), with a zero loss."""

    def gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
        return {n: torch.ones_like(p[n]) for n in trainable}, (p["bias"] * 0).sum()

    return gradient


def test_looping_over_clients_follows_a_custom_step_direction() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys, loop_over_clients=True)
    got = ctx.sgd(params, ["weight", "bias"], 1, gradient=ones_gradient(["weight", "bias"]))
    for n in params:  # one step of the first (momentum-free) SGD step along the ones
        assert_close_finite(got[n], params[n] - LR, rtol=1e-6, atol=1e-7)


def test_looping_over_clients_adds_the_penalty() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    anchor = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(4))
    pen = Penalty(lambda p, d: ((p["weight"] - d["a"]) ** 2).sum(), {"a": anchor})
    got = context(net, xs, ys, loop_over_clients=True).sgd(params, ["weight", "bias"], 2, penalty=pen)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: linear_loss(x, y)(p) + ((p["weight"] - anchor[k]) ** 2).sum()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 2)


def test_a_looped_client_without_samples_reports_its_loss_on_the_device() -> None:
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(0, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(0, dtype=torch.long, device=meta)]
    net = nn.Linear(4, 3)
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    ctx = context(net, xs, ys, loop_over_clients=True)
    ctx.sgd(params, ["weight", "bias"], 1)
    assert ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)


def test_client_by_client_steps_are_counted_on_the_device() -> None:
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(3, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(3, dtype=torch.long, device=meta)]
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    adagrad = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.Adagrad, lr=LR))
    ctx = context(net, xs, ys, optimizer=adagrad)
    ctx.sgd(params, ["head.weight", "head.bias"], 1)
    assert ctx.steps_taken.device == meta and ctx.steps_taken.shape == (2,)


def test_an_optimizer_without_batched_form_is_named_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(executors, "_fallbacks_logged", set())
    xs, ys = data()
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    adagrad = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.Adagrad, lr=LR))
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        context(net, xs, ys, optimizer=adagrad).sgd(stacked_params(net, 2), ["head.weight", "head.bias"], 1)
    assert [r.getMessage() for r in caplog.records] == [
        "vectorized executor: client optimizer Adagrad has no batched form: clients run in turn"
    ]


class Doubling:
    """An augmentation that doubles the inputs; with ``ahead`` it draws ahead (``draw``/``apply``)."""

    def __call__(self, x: Tensor, g: torch.Generator) -> Tensor:
        return 2.0 * x


class DoublingAhead(Doubling):
    def draw(self, n: int, g: torch.Generator) -> Tensor:
        return torch.randint(0, 5, (n, 1), generator=g)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return 2.0 * x


@pytest.mark.parametrize("augment", [Doubling(), DoublingAhead()], ids=["per_batch", "ahead"])
def test_augmentations_are_applied_and_only_those_that_cannot_draw_ahead_run_in_turn(
    augment: Doubling, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(executors, "_fallbacks_logged", set())
    xs, ys = data()
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    params = stacked_params(net, 2)
    head = ["head.weight", "head.bias"]
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        got = context(net, xs, ys, augment=augment).sgd(params, head, 1)
    in_turn = ["vectorized executor: the augmentation cannot draw ahead: clients run in turn"]
    assert [r.getMessage() for r in caplog.records] == ([] if hasattr(augment, "draw") else in_turn)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: F.cross_entropy(2.0 * x @ p["head.weight"].T + p["head.bias"], y)

    check_clients(got, params, xs, (loss, ys), head, 1)


# ---- head-only phases --------------------------------------------------------------------------------------------
def split_net() -> SplitModel:
    return SplitModel(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3))


def split_loss(x: Tensor, y: Tensor) -> Callable[[Params], Tensor]:
    return lambda p: F.cross_entropy(
        torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"]) @ p["head.weight"].T + p["head.bias"], y
    )


def test_a_head_phase_with_a_custom_step_direction_trains_on_the_whole_network() -> None:
    xs, ys = data()
    net = split_net()
    params = stacked_params(net, 2)
    ctx = context(net, xs, ys)
    head = ["head.weight", "head.bias"]

    def gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
        q = {n: p[n] for n in head}
        return grad_and_value(lambda h: 2.0 * ctx.batch_loss({**p, **h}, x, y, m))(q)

    got = ctx.sgd(params, head, 1, gradient=gradient)
    check_clients(got, params, xs, (lambda x, y, k: lambda p: 2.0 * split_loss(x, y)(p), ys), head, 1)


def test_a_head_phase_sees_the_augmented_features() -> None:
    xs, ys = data()
    net = split_net()
    params = stacked_params(net, 2)
    head = ["head.weight", "head.bias"]
    got = context(net, xs, ys, augment=DoublingAhead()).sgd(params, head, 1)
    check_clients(got, params, xs, (lambda x, y, k: split_loss(2.0 * x, y), ys), head, 1)


def test_a_shared_body_passes_the_cohorts_augmented_batches_at_once() -> None:
    xs, ys = data()
    net = split_net()
    calls: list[int] = []
    net.body[0].register_forward_hook(lambda *_: calls.append(1))
    params = stacked_params(net, 1)
    shared = {n: v.expand(2, *v.shape[1:]) if n.startswith("body.") else v.repeat(2, *[1] * (v.dim() - 1))
              for n, v in params.items()}  # fmt: skip
    head = ["head.weight", "head.bias"]
    got = context(net, xs, ys, augment=DoublingAhead()).sgd(shared, head, 1)
    assert len(calls) == 1  # 7 rows of both clients in one body pass
    check_clients(got, shared, xs, (lambda x, y, k: split_loss(2.0 * x, y), ys), head, 1)


class BodyHead(nn.Module):
    """A network with a body and a head but no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def test_a_body_and_head_network_without_a_side_attribute_trains_its_head() -> None:
    xs, ys = data()
    net = BodyHead()
    params = stacked_params(net, 2)
    head = ["head.weight", "head.bias"]
    got = context(net, xs, ys).sgd(params, head, 1)
    check_clients(got, params, xs, (lambda x, y, k: split_loss(x, y), ys), head, 1)


def side_net() -> SplitModel:
    return SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(5, 3), Concat(nn.Linear(2, 2)))


def test_a_side_branch_network_without_side_data_is_refused_even_for_its_head() -> None:
    xs, ys = data()
    net = side_net()
    with pytest.raises(ValueError, match="side"):
        context(net, xs, ys).sgd(stacked_params(net, 2), ["head.weight", "head.bias"], 1)


def test_side_data_reach_every_clients_vmapped_step() -> None:
    xs, ys = data()
    net = side_net()
    params = stacked_params(net, 2)
    sides = [torch.tensor([1.0, -1.0]), torch.tensor([0.5, 2.0])]
    got = context(net, xs, ys, sides=sides).sgd(params, list(params), 1)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        def f(p: Params) -> Tensor:
            feats = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
            side = (sides[k] @ p["side.embed.weight"].T + p["side.embed.bias"]).expand(x.shape[0], 2)
            return F.cross_entropy(torch.cat([feats, side], 1) @ p["head.weight"].T + p["head.bias"], y)

        return f

    check_clients(got, params, xs, (loss, ys), list(params), 1)


# ---- plan_phase and stack ---------------------------------------------------------------------------------------
def test_a_plan_for_no_clients_has_no_steps() -> None:
    plan = plan_phase([], [], [], [], None, 2, 3, 1, None, torch.device("cpu"))
    assert plan.num_steps == 0 and plan.rows.shape == (0, 0, 3) and plan.rows.dtype == torch.long
    assert plan.steps.dtype == torch.long and plan.steps.shape == (0,) and plan.draws is None


def test_one_clients_one_draw_per_sample_is_planned() -> None:
    g = torch.Generator().manual_seed(3)
    plan = plan_phase([1], [0], [g], [1.0], DoublingAhead(), 1, 1, 1, None, torch.device("cpu"))
    expected = torch.Generator().manual_seed(3)
    torch.randperm(1, generator=expected)
    drawn = torch.randint(0, 5, (1, 1), generator=expected)
    assert plan.rows.tolist() == [[[0]]] and plan.steps.tolist() == [1]
    assert plan.draws is not None and plan.draws.shape == (1, 1, 1, 1)
    assert plan.draws.dtype == torch.long and plan.draws.view(-1).tolist() == drawn.view(-1).tolist()


def test_draws_are_planned_when_the_first_client_takes_no_step() -> None:
    """Client 0 has no sample (no step, no draw), client 1 three: the plan still carries client 1's draws (the draw
    width comes from a client that drew), and client 0's slots are padding."""
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(4)]
    plan = plan_phase([0, 3], [0, 0], gens, [1.0, 1.0], DoublingAhead(), 1, 3, 1, None, torch.device("cpu"))
    expected = torch.Generator().manual_seed(4)
    perm = torch.randperm(3, generator=expected)
    drawn = torch.randint(0, 5, (3, 1), generator=expected)
    assert plan.host_steps == [0, 1] and plan.rows[0, 0].tolist() == [-1, -1, -1]
    assert plan.rows[0, 1].tolist() == perm.tolist()
    assert plan.draws is not None and plan.draws.shape == (1, 2, 3, 1)
    assert plan.draws[0, 1].view(-1).tolist() == drawn.view(-1).tolist()


def test_padding_rows_are_minus_one() -> None:
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    plan = plan_phase([3, 1], [0, 3], gens, [1.0, 1.0], None, 1, 2, 1, None, torch.device("cpu"))
    assert plan.host_steps == [2, 1] and plan.lengths == [[2, 1], [1]]
    rows = plan.rows
    assert sorted(rows[:, 0].flatten().tolist()) == [-1, 0, 1, 2]  # client 0: its 3 rows, one padding slot
    assert rows[1, 0, 1].item() == -1  # the partial batch's padding
    assert rows[0, 1].tolist() == [3, -1] and rows[1, 1].tolist() == [-1, -1]  # client 1: one row, then a pad step


def test_stacking_nothing_gives_nothing() -> None:
    assert stack([]) == {}
    assert stack([{"a": torch.ones(2)}, {"a": torch.zeros(2)}])["a"].tolist() == [[1.0, 1.0], [0.0, 0.0]]
