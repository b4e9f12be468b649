"""``fl_lightning/engine/stacked.py`` (the vectorized executor): ``VectorizedContext.sgd``, its batched sub-paths
and state devices, against plain-torch references written here (the arithmetic it steps with: test_stacked_nets.py,
test_batched_optim.py, test_phases.py; its clients in turn: test_stacked_in_turn.py; the sub-path plan:
test_stacked_paths.py)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.nn import functional as F

import fl_lightning.engine.stacked as executors
from fl_lightning.client import ClientOptimizer, Objective, Penalty
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for, state_template
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import (
    per_sample_loss_for,
    stack,
    unstack,
)
from fl_lightning.engine.state import state_name
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import Concat, SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

CL = torch.channels_last
LR = 0.1
Params = dict[str, Tensor]


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


def test_a_fresh_context_lists_its_names_and_stacks_its_side_data() -> None:
    """Before any phase: the trainable parameter names (frozen ones left out) and the buffer names in the network's
    order, the clients' side vectors stacked ``[K, ...]``, no body pass made and nothing collected."""
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    net[2].bias.requires_grad_(False)
    xs, ys = [torch.zeros(2, 4), torch.zeros(3, 4)], [torch.zeros(n, dtype=torch.long) for n in (2, 3)]
    sides = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    ctx = VectorizedContext(net, [4, 7], xs, ys, sides, ClientOptimizer(), per_sample_loss_for(3),
                            [torch.Generator(), torch.Generator()], None, 0, 0, [1.0, 1.0])  # fmt: skip
    assert ctx.param_names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    assert ctx.buffer_names == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert torch.equal(ctx.sides, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert ctx.feature_passes == 0 and ctx.class_sums_seen is None and ctx.optimizer_state is None
    assert context(xs, ys).sides is None


def test_label_counts_of_a_context_without_clients_is_an_empty_table() -> None:
    counts = context([], []).label_counts(3)
    assert counts.shape == (0, 3) and counts.dtype == torch.long and counts.device == torch.device("cpu")


def test_a_step_cap_function_is_asked_per_client_with_its_size_and_budget() -> None:
    """``max_steps`` as a function: one cap per client from its own (size, budget); a number is every client's."""
    xs, ys = data()
    ctx = context_2(nn.Linear(4, 3), xs, ys)
    ctx.step_budgets = [1.0, 0.5]
    assert ctx._caps(lambda n, budget: (n, budget)) == [(4, 1.0), (3, 0.5)]
    assert ctx._caps(3) == 3 and ctx._caps(None) is None


def test_objective_collect_starts_with_zero_sums_per_client() -> None:
    """A phase with an ``Objective.collect`` and no epochs: zero sums ``[K, C, D]`` and counts ``[K, C]``."""
    xs, ys = data()
    net = nn.Linear(4, 3)
    ctx = context_2(net, xs, ys)
    ctx.sgd(stacked_params(net, 2), ["weight", "bias"], 0, objective=Objective(_values_to_collect, collect=(3, 4)))
    assert [tuple(t.shape) for t in ctx.class_sums_seen] == [(2, 3, 4), (2, 3)]
    assert all(float(t.abs().sum()) == 0 for t in ctx.class_sums_seen)


def test_batchnorm_clients_normalise_a_full_batch_with_its_own_statistics() -> None:
    """One full-batch step of a BatchNorm1d network per client (float64): parameters and running statistics as
    ``functional_call`` with torch's train-mode BatchNorm and one momentum SGD step give them."""
    xs, ys, net, params, names = batchnorm_clients()
    got = context_2(net, xs, ys).sgd(params, names, 1)
    assert_each_client_is_its_own_sgd(net, xs, ys, params, names, got, 10, list(params), rtol=1e-9, atol=1e-10)


def test_fresh_context_batch_loss_is_the_plain_loss() -> None:
    g = torch.Generator().manual_seed(3)
    xs, ys = [torch.randn(6, 4, generator=g)], [torch.randint(0, 3, (6,), generator=g)]
    net = nn.Linear(4, 3)
    ctx = context(xs, ys, net)
    params = {n: p.detach() for n, p in net.named_parameters()}
    got = ctx.batch_loss(params, xs[0], ys[0])
    want = F.cross_entropy(xs[0] @ params["weight"].T + params["bias"], ys[0])
    assert_close_finite(got, want, rtol=1e-6, atol=1e-7)


def test_a_conv_net_on_the_cpu_runs_client_by_client_by_default() -> None:
    """``loop_over_clients`` defaults to True for a convolutional net on the CPU, False for an MLP."""
    xs, ys = [torch.rand(3, 1, 8, 8)], [torch.zeros(3, dtype=torch.long)]

    def context(net: nn.Module) -> VectorizedContext:
        opt = ClientOptimizer()
        return VectorizedContext(net, [0], xs, ys, None, opt, per_sample_loss_for(10), [torch.Generator()], None, 0,
                                 0, [1.0])  # fmt: skip

    assert context(DigitsCNN()).loop_over_clients is True
    assert context(DigitsMLP()).loop_over_clients is False


# ---- shared data -------------------------------------------------------------------------------------------------
SIZES = [9, 3, 12]


def images(sizes: list[int]) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 8, 8, generator=g) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    return xs, ys


def generators(n: int) -> list[torch.Generator]:
    return [make_generator(5, "train", 0, k) for k in range(n)]


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


def ones_gradient(trainable: list[str]) -> Callable:
    """A custom step direction: all ones (not the loss's gradient), with a zero loss."""

    def gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
        return {n: torch.ones_like(p[n]) for n in trainable}, (p["bias"] * 0).sum()

    return gradient


def data(sizes: tuple[int, ...] = (4, 3), dim: int = 4, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, dim, generator=g) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in sizes]
    return xs, ys


def context_2(
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
    ctx = context_2(net, xs, ys)
    got = ctx.sgd(params, ["weight", "bias"], 2, penalty=lambda p: 3.0 * (p["weight"] ** 2).sum())

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: linear_loss(x, y)(p) + 3.0 * (p["weight"] ** 2).sum()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 2)


def test_max_steps_stops_every_client() -> None:
    """A number stops every client there; a function ``(num_samples, step_budget) -> steps`` is asked once per
    client with its own size and budget, and each client stops at its own cap (full-batch steps here)."""
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context_2(net, xs, ys)
    got = ctx.sgd(params, ["weight", "bias"], 3, max_steps=1)
    assert ctx.steps_taken.tolist() == [1, 1]
    check_clients(got, params, xs, (lambda x, y, k: linear_loss(x, y), ys), ["weight", "bias"], 1)
    asked: list[tuple[int, float]] = []

    def cap(n: int, budget: float) -> int:
        asked.append((n, budget))
        return n - 2  # client 0 (4 samples): 2 steps, client 1 (3 samples): 1 step

    ctx = context_2(net, xs, ys)
    ctx.step_budgets = [1.0, 0.9]  # both still allow all 3 epochs' steps (⌊0.9·3⌋ = 2 ≥ 1)
    got = ctx.sgd(params, ["weight", "bias"], 3, max_steps=cap)
    assert asked == [(4, 1.0), (3, 0.9)]
    assert ctx.steps_taken.tolist() == [2, 1]
    for k, steps in enumerate([2, 1]):
        want = reference(linear_loss(xs[k], ys[k]), unstack(params, k), ["weight", "bias"], steps)
        for n in params:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")


def minibatch_reference(
    loss_of: Callable[[Params, Tensor], Tensor],
    params: Params,
    trainable: list[str],
    k: int,
    n: int,
    bs: int,
    bufs: Params | None = None,
    lr: float = LR,
    min_batch: int = 1,
    dampening: float = 0.0,
) -> tuple[Params, float, Params]:
    """One epoch of client ``k``'s minibatch momentum SGD (momentum 0.5, ``dampening``) written out on
    ``context_2``'s generator: its shuffle, then batches of ``bs`` rows ``idx`` in order (those of fewer than
    ``min_batch`` skipped), each a step on ``loss_of(params, idx)`` (which may update untrained tensors in place, as
    BatchNorm updates its running statistics), continuing from momentum buffers ``bufs`` when given. Returns
    (params, mean step loss, momentum buffers)."""
    g = torch.Generator().manual_seed(5 + k)
    p, buf, losses = {m: v.clone() for m, v in params.items()}, dict(bufs or {}), []
    perm = torch.randperm(n, generator=g)
    for i in range(0, n, bs):
        if len(perm[i : i + bs]) < min_batch:
            continue
        leaves = {m: v.clone().requires_grad_(m in trainable) for m, v in p.items()}
        value = loss_of(leaves, perm[i : i + bs])
        p.update({m: v.detach() for m, v in leaves.items() if m not in trainable})
        for m, grad in zip(trainable, torch.autograd.grad(value, [leaves[m] for m in trainable])):
            buf[m] = grad if m not in buf else 0.5 * buf[m] + (1 - dampening) * grad
            p[m] = p[m] - lr * buf[m]
        losses.append(float(value.detach()))
    return p, sum(losses) / len(losses), buf


def batchnorm_clients() -> tuple[list[Tensor], list[Tensor], nn.Module, Params, list[str]]:
    """Two clients of a float64 BatchNorm1d network (a batch of two has a tiny variance: float32 rounding shows),
    each with its own running statistics: (xs, ys, net, stacked params and buffers, parameter names)."""
    xs, ys = data()
    xs = [x.double() for x in xs]
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3)).double()
    params = {n: v.double() for n, v in stacked_params(net, 2).items()}
    params.update({n: torch.stack([b.clone(), b.clone() + 1]) for n, b in net.named_buffers()})
    return xs, ys, net, params, [n for n, _ in net.named_parameters()]


def assert_each_client_is_its_own_sgd(
    net: nn.Module, xs: list[Tensor], ys: list[Tensor], params: Params, names: list[str], got: Params,
    bs: int, compared: list[str], rtol: float, atol: float, min_batch: int = 1,
) -> None:  # fmt: skip
    """Every client's ``compared`` entries of ``got`` equal one epoch of its own minibatch momentum SGD on the whole
    network's cross-entropy (``minibatch_reference``: ``functional_call`` and plain autograd)."""
    for k, (x, y) in enumerate(zip(xs, ys)):

        def loss_of(p: Params, idx: Tensor, x: Tensor = x, y: Tensor = y) -> Tensor:
            return F.cross_entropy(functional_call(net, p, (x[idx],)), y[idx])

        want, _, _ = minibatch_reference(loss_of, unstack(params, k), names, k, x.shape[0], bs, min_batch=min_batch)
        for n in compared:
            assert_close_finite(got[n][k], want[n], rtol=rtol, atol=atol, msg=f"client {k} {n}")


def test_a_closed_form_penalty_gradient_joins_each_clients_steps() -> None:
    """A ``Penalty`` with its gradient in closed form and per-client data (½μ_k‖w‖² with μ_k·w) on the stacked
    path: each client steps as its own loss + penalty through autograd, and reports that loss; client 1's one
    sample is a batch of one real row and it stops after one step, while client 0 takes two."""
    xs, ys = data(sizes=(4, 1))
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    mu = torch.tensor([0.5, 2.0])
    penalty = Penalty(lambda p, d: 0.5 * d["mu"] * (p["weight"] ** 2).sum(), {"mu": mu},
                      gradient=lambda p, d: {"weight": d["mu"] * p["weight"]})  # fmt: skip
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer(lr=LR, batch_size=2))
    got = ctx.sgd(params, ["weight", "bias"], 1, penalty=penalty)
    assert ctx.steps_taken.tolist() == [2, 1]
    for k, (x, y) in enumerate(zip(xs, ys)):

        def loss_of(p: Params, idx: Tensor, x: Tensor = x, y: Tensor = y, k: int = k) -> Tensor:
            return F.cross_entropy(x[idx] @ p["weight"].T + p["bias"], y[idx]) + 0.5 * mu[k] * (p["weight"] ** 2).sum()

        want, loss, _ = minibatch_reference(loss_of, unstack(params, k), ["weight", "bias"], k, x.shape[0], 2)
        for n in params:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")
        assert_close_finite(ctx.train_loss[k], loss, rtol=1e-5, atol=1e-6, msg=f"client {k} loss")


def test_a_closed_form_penalty_gradient_joins_each_clients_vmapped_steps() -> None:
    """As above on a network that is not stacked (a LayerNorm: its steps are ``vmap``-ed): each client steps as its
    own loss + ½μ_k‖W‖² through autograd (``functional_call``), with 2 and 1 steps."""
    xs, ys = data(sizes=(4, 1))
    net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    params = stacked_params(net, 2)
    mu = torch.tensor([0.5, 2.0])
    penalty = Penalty(lambda p, d: 0.5 * d["mu"] * (p["0.weight"] ** 2).sum(), {"mu": mu},
                      gradient=lambda p, d: {"0.weight": d["mu"] * p["0.weight"]})  # fmt: skip
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer(lr=LR, batch_size=2))
    names = list(params)
    got = ctx.sgd(params, names, 1, penalty=penalty)
    assert ctx.steps_taken.tolist() == [2, 1]
    for k, (x, y) in enumerate(zip(xs, ys)):

        def loss_of(p: Params, idx: Tensor, x: Tensor = x, y: Tensor = y, k: int = k) -> Tensor:
            out = functional_call(net, p, (x[idx],))
            return F.cross_entropy(out, y[idx]) + 0.5 * mu[k] * (p["0.weight"] ** 2).sum()

        want, loss, _ = minibatch_reference(loss_of, unstack(params, k), names, k, x.shape[0], 2)
        for n in names:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")
        assert_close_finite(ctx.train_loss[k], loss, rtol=1e-5, atol=1e-6, msg=f"client {k} loss")


def test_a_step_direction_gets_each_clients_penalty_gradient_added() -> None:
    """A ``Gradient`` of all ones plus a penalty ½μ_k‖W‖² (no closed form): client k's one full-batch step is
    ``W − lr·(1 + μ_k·W)`` and ``b − lr`` (the first momentum step is the gradient)."""
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    mu = torch.tensor([0.5, 2.0])
    penalty = Penalty(lambda p, d: 0.5 * d["mu"] * (p["weight"] ** 2).sum(), {"mu": mu})
    got = context_2(net, xs, ys).sgd(params, ["weight", "bias"], 1, penalty,
                                     gradient=ones_gradient(["weight", "bias"]))  # fmt: skip
    for k in range(2):
        w, b = params["weight"][k], params["bias"][k]
        assert_close_finite(got["weight"][k], w - LR * (1 + mu[k] * w), rtol=1e-6, atol=1e-7, msg=f"client {k}")
        assert_close_finite(got["bias"][k], b - LR, rtol=1e-6, atol=1e-7, msg=f"client {k}")


def test_values_a_step_direction_sets_stay_with_the_clients_that_stepped() -> None:
    """A ``Gradient`` that also sets an untrained name (``bias + 1`` each step, in float64): client 0 takes two
    steps and client 1 one, so the bias grows by 2 and 1, in the parameter's dtype."""
    xs, ys = data(sizes=(4, 2))
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer(lr=LR, batch_size=2))

    def gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor, Params]:
        g, loss = grad_and_value(lambda w: ctx.batch_loss({**p, "weight": w}, x, y, m))(p["weight"])
        return {"weight": g}, loss, {"bias": (p["bias"] + 1).double()}

    got = ctx.sgd(params, ["weight"], 1, gradient=gradient)
    assert ctx.steps_taken.tolist() == [2, 1]
    assert got["bias"].dtype == params["bias"].dtype
    assert_close_finite(got["bias"], params["bias"] + torch.tensor([[2.0], [1.0]]), rtol=1e-6, atol=1e-6)


def test_kept_momentum_continues_per_client_and_counts_each_clients_steps() -> None:
    """Kept state on the stacked path: each client continues from its own momentum buffers (not zeros) and step
    counts (5 and 7: no first step, so SGD's dampening 0.3 applies from the start), takes its own steps (2 and 1)
    and writes back its buffers and counts + steps."""
    xs, ys = data(sizes=(4, 2))
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    g = torch.Generator().manual_seed(9)
    bufs = {n: torch.randn(2, *p.shape, generator=g) for n, p in net.named_parameters()}
    kept = {state_name("steps", n): torch.tensor([5, 7]) for n in params}
    kept.update({state_name("momentum_buffer", n): bufs[n].clone() for n in params})
    damped = functools.partial(torch.optim.SGD, lr=LR, momentum=0.5, dampening=0.3)
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer.from_config(damped, batch_size=2))
    ctx.optimizer_state = kept
    got = ctx.sgd(params, ["weight", "bias"], 1)
    assert ctx.optimizer_state[state_name("steps", "weight")].tolist() == [7, 8]
    assert ctx.optimizer_state[state_name("steps", "bias")].tolist() == [7, 8]
    for k, (x, y) in enumerate(zip(xs, ys)):

        def loss_of(p: Params, idx: Tensor, x: Tensor = x, y: Tensor = y) -> Tensor:
            return F.cross_entropy(x[idx] @ p["weight"].T + p["bias"], y[idx])

        want, _, buf = minibatch_reference(loss_of, unstack(params, k), ["weight", "bias"], k, x.shape[0], 2,
                                           bufs=unstack(bufs, k), dampening=0.3)  # fmt: skip
        for n in params:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")
            kept_buf = ctx.optimizer_state[state_name("momentum_buffer", n)][k]
            assert_close_finite(kept_buf, buf[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n} buffer")


def test_one_client_trains_with_the_phases_lr_and_drops_its_partial_batch() -> None:
    """A context of one client trains it (a cohort of one is not empty); the phase's ``lr`` replaces the round's,
    and ``drop_last`` skips the client's last batch of 1 (3 samples in batches of 2: one step)."""
    xs, ys = data(sizes=(3,))
    net = nn.Linear(4, 3)
    params = stacked_params(net, 1)
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer(lr=LR, batch_size=2, drop_last=True))
    got = ctx.sgd(params, ["weight", "bias"], 1, lr=0.05)
    assert ctx.steps_taken.tolist() == [1]

    def loss_of(p: Params, idx: Tensor) -> Tensor:
        return F.cross_entropy(xs[0][idx] @ p["weight"].T + p["bias"], ys[0][idx])

    want, _, _ = minibatch_reference(loss_of, unstack(params, 0), ["weight", "bias"], 0, 3, 2, lr=0.05, min_batch=2)
    for n in params:
        assert_close_finite(got[n][0], want[n], rtol=1e-5, atol=1e-6, msg=n)


class _Recurrent(nn.Module):
    """An LSTM over each sample's 4 features as a sequence of 2 steps, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(2, 3, batch_first=True), nn.Linear(3, 3)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.head(self.lstm(x.view(x.shape[0], 2, 2))[0][:, -1])


def test_a_recurrent_network_trains_its_clients_in_turn() -> None:
    """A network with an LSTM (no batching rule for per-client weights) trains client by client: each client as
    its own minibatch momentum SGD on the whole network (full batches)."""
    torch.manual_seed(0)
    xs, ys = data()
    net = _Recurrent()
    params = stacked_params(net, 2)
    names = list(params)
    got = context_2(net, xs, ys).sgd(params, names, 1)
    assert_each_client_is_its_own_sgd(net, xs, ys, params, names, got, 10, names, rtol=1e-5, atol=1e-6)


def test_batchnorm_clients_train_on_their_own_batch_statistics_and_skip_a_batch_of_one() -> None:
    """A BatchNorm1d network on the stacked path: each client normalises with its own batches' statistics and ends
    with its own running statistics, as torch's BatchNorm in train mode; the default ``min_batch`` skips client 1's
    last batch of one sample (3 samples in batches of 2), so the clients take 2 and 1 steps."""
    torch.manual_seed(0)
    xs, ys, net, params, names = batchnorm_clients()
    ctx = context_2(net, xs, ys, optimizer=ClientOptimizer(lr=LR, batch_size=2))
    got = ctx.sgd(params, names, 1)
    assert ctx.steps_taken.tolist() == [2, 1]
    assert_each_client_is_its_own_sgd(net, xs, ys, params, names, got, 2, list(params), rtol=1e-9, atol=1e-10,
                                      min_batch=2)  # fmt: skip


def test_a_head_phase_with_an_objective_trains_on_the_objective() -> None:
    """A head-only phase on a split network with an ``Objective`` (here twice the cross-entropy per sample) trains
    on the objective, not on the network's loss over cached features."""
    xs, ys = data()
    net = SplitModel(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3))
    params = stacked_params(net, 2)
    head = ["head.weight", "head.bias"]
    ctx = context_2(net, xs, ys)

    def twice(p: Params, x: Tensor, y: Tensor, d: Params) -> Tensor:
        return 2 * ctx.per_sample_loss(ctx.forward(p, x), y)

    got = ctx.sgd(params, head, 1, objective=Objective(twice))
    check_clients(got, params, xs, (lambda x, y, k: lambda p: 2 * split_loss(x, y)(p), ys), head, 1)


class ScaleAhead:
    """An augmentation that draws ahead an integer per sample (the plan carries draws as integers, as crop offsets
    and flips are) and applies ``x·(1 + s)``."""

    def draw(self, n: int, g: torch.Generator) -> Tensor:
        return torch.randint(0, 3, (n, 1), generator=g)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return x * (1 + drawn)


def test_a_whole_network_phase_trains_on_each_clients_augmented_batches() -> None:
    """Training the whole (stacked) network with an augmentation that draws ahead: each client's full batch is its
    shuffled rows scaled by the scales it drew after its shuffle (its generator, ``epoch_draws``' order)."""
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    got = context_2(net, xs, ys, augment=ScaleAhead()).sgd(params, ["weight", "bias"], 1)
    for k, (x, y) in enumerate(zip(xs, ys)):
        g = torch.Generator().manual_seed(5 + k)  # context_2's generator of client k
        perm = torch.randperm(x.shape[0], generator=g)
        scaled = x[perm] * (1 + torch.randint(0, 3, (x.shape[0], 1), generator=g))
        want = reference(linear_loss(scaled, y[perm]), unstack(params, k), ["weight", "bias"], 1)
        for n in params:
            assert_close_finite(got[n][k], want[n], rtol=1e-5, atol=1e-6, msg=f"client {k} {n}")


def _values_to_collect(q: Params, x: Tensor, y: Tensor, d: Params) -> tuple[Tensor, ...]:
    """One client's per-sample losses, its own constant ``reported`` (the objective's data) reported instead, and
    values ``10·x + 1`` to collect that do not depend on the parameters."""
    per = F.cross_entropy(x @ q["weight"].T + q["bias"], y, reduction="none")
    return per, torch.ones_like(per) * d["reported"], 10 * x + 1


def test_objective_collect_sums_each_clients_last_epoch_by_class() -> None:
    """``Objective.collect`` on the stacked path: ``class_sums_seen`` is ``[K, C, D]`` sums and ``[K, C]`` counts of
    each client's values over its own last epoch (2 epochs of one batch: every row of the client once), against
    numpy; ``train_loss`` is what the objective reports; a phase without epochs leaves zeros of those shapes."""
    xs, ys = data()
    net = nn.Linear(4, 3)
    objective = Objective(_values_to_collect, {"reported": torch.tensor([3.0, 5.0])}, collect=(3, 4))
    ctx = context_2(net, xs, ys)  # full batches: each epoch is one step
    ctx.sgd(stacked_params(net, 2), ["weight", "bias"], 0, objective=objective)
    assert [tuple(t.shape) for t in ctx.class_sums_seen] == [(2, 3, 4), (2, 3)]
    assert all(float(t.abs().sum()) == 0 for t in ctx.class_sums_seen)
    ctx.sgd(stacked_params(net, 2), ["weight", "bias"], 2, objective=objective)
    sums, counts = ctx.class_sums_seen
    for k, (x, y) in enumerate(zip(xs, ys)):
        values, labels = (10 * x + 1).numpy(), y.numpy()
        expected = np.stack([values[labels == c].sum(0) for c in range(3)])
        assert_close_finite(sums[k], expected, rtol=1e-5, atol=1e-5, msg=f"client {k}")
        assert counts[k].tolist() == np.bincount(labels, minlength=3).astype(float).tolist()
    assert ctx.train_loss.tolist() == [3.0, 5.0]  # what the objective reports (its data), not its loss


def test_linear_networks_step_without_vmap(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_vmap(*args: object, **kwargs: object) -> None:
        raise AssertionError("vmap used")

    monkeypatch.setattr(executors, "vmap", no_vmap)
    xs, ys = data()
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    params = stacked_params(net, 2)
    got = context_2(net, xs, ys).sgd(params, list(params), 1)

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
    got = context_2(net, xs, ys).sgd(params, list(params), 2, penalty=pen)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: (
            F.cross_entropy(F.hardtanh(x @ p["0.weight"].T + p["0.bias"]), y) + ((p["0.weight"] - anchor[k]) ** 2).sum()
        )

    check_clients(got, params, xs, (loss, ys), list(params), 2)


def test_a_trained_name_the_network_does_not_use_stays_as_it_is() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = {**stacked_params(net, 2), "extra": torch.ones(2, 5)}
    got = context_2(net, xs, ys).sgd(params, ["weight", "bias", "extra"], 1)
    assert_close_finite(got["extra"], torch.ones(2, 5), rtol=0, atol=0)
    base = {n: v for n, v in params.items() if n != "extra"}
    check_clients(got, base, xs, (lambda x, y, k: linear_loss(x, y), ys), ["weight", "bias"], 1)


def test_the_autograd_step_leaves_an_unused_trained_name_and_averages_a_one_row_batch() -> None:
    """A stacked network that is not a ReLU one (a Tanh output: the step takes autograd's gradient): a trained name
    the network does not use stays as it is, and client 1's batch of one real row (padded to client 0's four) is
    its mean over that one row; each client ends where its own torch SGD ends and reports its own loss."""
    xs, ys = data(sizes=(4, 1))
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    params = {**stacked_params(net, 2), "extra": torch.ones(2, 5)}
    ctx = context_2(net, xs, ys)
    got = ctx.sgd(params, ["0.weight", "0.bias", "extra"], 1)
    assert_close_finite(got["extra"], torch.ones(2, 5), rtol=0, atol=0)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: F.cross_entropy(torch.tanh(x @ p["0.weight"].T + p["0.bias"]), y)

    base = {n: v for n, v in params.items() if n != "extra"}
    check_clients(got, base, xs, (loss, ys), ["0.weight", "0.bias"], 1)
    for k in range(2):
        assert_close_finite(ctx.train_loss[k], loss(xs[k], ys[k], k)(unstack(base, k)), rtol=1e-6, atol=1e-7)


def test_regression_targets_with_several_outputs() -> None:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g)]
    ys = [torch.randn(4, 2, generator=g), torch.randn(3, 2, generator=g)]
    net = nn.Linear(4, 2)
    params = stacked_params(net, 2)
    got = context_2(net, xs, ys, num_classes=None).sgd(params, ["weight", "bias"], 1)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: 0.5 * ((x @ p["weight"].T + p["bias"] - y) ** 2).mean()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 1)


def test_float64_clients_keep_their_losses_in_float64() -> None:
    xs, ys = data()
    xs = [x.double() for x in xs]
    net = nn.Linear(4, 3).double()
    params = {n: v.double() for n, v in stacked_params(net, 2).items()}
    ctx = context_2(net, xs, ys)
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
    ctx = context_2(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1, penalty=pen)
    assert ctx.train_loss.dtype == torch.float32


# ---- phases that do nothing -------------------------------------------------------------------------------------
def test_no_epochs_or_nothing_to_train_leaves_the_last_phase_and_the_generators() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    ctx = context_2(net, xs, ys)
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
    ctx = context_2(net, xs, ys)
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
    ctx = context_2(net, xs, ys, optimizer=damped)
    out = ctx.sgd(params, ["weight", "bias"], 2)
    assert out["weight"].device == meta and ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)


def test_a_phase_without_steps_reports_its_zero_losses_on_the_clients_device() -> None:
    """``max_steps=0`` on ``meta`` data (an accelerator's stand-in): the zero losses per client are on that device."""
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(3, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(3, dtype=torch.long, device=meta)]
    net = nn.Linear(4, 3)
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    ctx = context_2(net, xs, ys)
    ctx.sgd(params, ["weight", "bias"], 1, max_steps=0)
    assert ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)


class Doubling:
    """An augmentation that doubles the inputs; with ``ahead`` it draws ahead (``draw``/``apply``)."""

    def __call__(self, x: Tensor, g: torch.Generator) -> Tensor:
        return 2.0 * x


class DoublingAhead(Doubling):
    def draw(self, n: int, g: torch.Generator) -> Tensor:
        return torch.randint(0, 5, (n, 1), generator=g)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return 2.0 * x


def _augmented_head_phase(augment: Doubling, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    xs, ys = data()
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    params = stacked_params(net, 2)
    head = ["head.weight", "head.bias"]
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        got = context_2(net, xs, ys, augment=augment).sgd(params, head, 1)
    in_turn = ["vectorized executor: the augmentation cannot draw ahead: clients run in turn"]
    assert [r.getMessage() for r in caplog.records] == ([] if hasattr(augment, "draw") else in_turn)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: F.cross_entropy(2.0 * x @ p["head.weight"].T + p["head.bias"], y)

    check_clients(got, params, xs, (loss, ys), head, 1)


# one test each (not parametrized): each runs under ``make mutation``'s per-function test cap
def test_an_augmentation_that_draws_ahead_is_applied_on_the_stacked_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _augmented_head_phase(DoublingAhead(), monkeypatch, caplog)


def test_an_augmentation_that_cannot_draw_ahead_is_applied_with_the_clients_in_turn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _augmented_head_phase(Doubling(), monkeypatch, caplog)


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
    ctx = context_2(net, xs, ys)
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
    got = context_2(net, xs, ys, augment=DoublingAhead()).sgd(params, head, 1)
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
    got = context_2(net, xs, ys, augment=DoublingAhead()).sgd(shared, head, 1)
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
    got = context_2(net, xs, ys).sgd(params, head, 1)
    check_clients(got, params, xs, (lambda x, y, k: split_loss(x, y), ys), head, 1)


def side_net() -> SplitModel:
    return SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(5, 3), Concat(nn.Linear(2, 2)))


def test_a_side_branch_network_without_side_data_is_refused_even_for_its_head() -> None:
    xs, ys = data()
    net = side_net()
    with pytest.raises(ValueError, match="side"):
        context_2(net, xs, ys).sgd(stacked_params(net, 2), ["head.weight", "head.bias"], 1)


def test_side_data_reach_every_clients_vmapped_step() -> None:
    xs, ys = data()
    net = side_net()
    params = stacked_params(net, 2)
    sides = [torch.tensor([1.0, -1.0]), torch.tensor([0.5, 2.0])]
    got = context_2(net, xs, ys, sides=sides).sgd(params, list(params), 1)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        def f(p: Params) -> Tensor:
            feats = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
            side = (sides[k] @ p["side.embed.weight"].T + p["side.embed.bias"]).expand(x.shape[0], 2)
            return F.cross_entropy(torch.cat([feats, side], 1) @ p["head.weight"].T + p["head.bias"], y)

        return f

    check_clients(got, params, xs, (loss, ys), list(params), 1)


def test_partly_kept_optimizer_state_is_updated_for_every_kept_parameter() -> None:
    """Kept momentum state for ``bias`` only (``weight`` starts fresh and is not kept), trainable order weight,
    bias: after two full-batch steps the kept bias buffer and step count are torch SGD's (momentum 0.5)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, generator=g), torch.randn(3, 3, generator=g)]
    ys = [torch.tensor([0, 1, 1, 0]), torch.tensor([1, 0, 1])]
    net = nn.Linear(3, 2)
    params = {n: torch.randn(2, *p.shape, generator=g) * 0.5 for n, p in net.named_parameters()}
    optimizer = ClientOptimizer(lr=0.1, batch_size=10)
    template = state_template(optimizer, {n: p.detach() for n, p in net.named_parameters()})
    kept = {k: v for k, v in template.items() if k.endswith(".bias")}
    gens = [torch.Generator().manual_seed(5 + i) for i in range(2)]
    ctx = VectorizedContext(net, range(2), xs, ys, None, optimizer, per_sample_loss_for(2), gens, None, 0, 0,
                            [1.0, 1.0])  # fmt: skip
    ctx.optimizer_state = stack([kept, kept])
    got = ctx.sgd(dict(params), ["weight", "bias"], 2)
    state = ctx.optimizer_state
    assert state is not None
    assert state[state_name("steps", "bias")].tolist() == [2, 2]
    assert not any(k.endswith(".weight") for k in state)
    for k in range(2):
        leaves = {n: v[k].clone().requires_grad_(True) for n, v in params.items()}
        opt = torch.optim.SGD([leaves["weight"], leaves["bias"]], lr=0.1, momentum=0.5)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(xs[k] @ leaves["weight"].T + leaves["bias"], ys[k]).backward()
            opt.step()
        buf = opt.state[leaves["bias"]]["momentum_buffer"]
        assert_close_finite(state[state_name("momentum_buffer", "bias")][k], buf, rtol=1e-5, atol=1e-6)
        for n in params:
            assert_close_finite(got[n][k], leaves[n].detach(), rtol=1e-5, atol=1e-6)


def test_integer_inputs_report_a_floating_training_loss() -> None:
    """Token ids through an embedding: the phase's loss is the float mean cross-entropy of the one full-batch step
    (not truncated to an integer), each client's at its starting parameters."""
    net = nn.Sequential(nn.Embedding(6, 3), nn.Flatten(), nn.Linear(3, 2))
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(2, *p.shape, generator=g) for n, p in net.named_parameters()}
    xs = [torch.tensor([[0], [3], [5]]), torch.tensor([[1], [2]])]
    ys = [torch.tensor([0, 1, 1]), torch.tensor([1, 0])]
    gens = [torch.Generator().manual_seed(5 + i) for i in range(2)]
    ctx = VectorizedContext(net, range(2), xs, ys, None, ClientOptimizer(lr=0.1, batch_size=10),
                            per_sample_loss_for(2), gens, None, 0, 0, [1.0, 1.0])  # fmt: skip
    ctx.sgd(dict(params), list(params), 1)
    want = []
    for k in range(2):
        emb = params["0.weight"][k][xs[k][:, 0]]
        logits = emb @ params["2.weight"][k].T + params["2.bias"][k]
        want.append(float(F.cross_entropy(logits, ys[k])))
    loss = torch.as_tensor(ctx.train_loss)
    assert loss.is_floating_point()
    assert_close_finite(loss, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_custom_gradient_gets_unit_weights_on_the_batch_device() -> None:
    """``_set_gradient`` hands the custom gradient one weight of 1 per row, on the rows' device (``meta`` stands in
    for an accelerator), and sets every leaf's ``grad`` to what it returns."""
    from types import SimpleNamespace

    from fl_lightning.engine.sequential import ClientContext

    seen: list[Tensor] = []

    def gradient(values: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        seen.append(w)
        return {"a": 2.0 * values["a"]}, (w * 0.5).sum()

    for device in ("cpu", "meta"):
        a = torch.tensor([1.0, -3.0], device=device)
        leaf = a.clone().requires_grad_(True)
        x, y = torch.zeros(3, 2, device=device), torch.zeros(3, device=device)
        ctx = SimpleNamespace(net=nn.Identity())  # a network without BatchNorm layers
        loss = ClientContext._set_gradient(ctx, gradient, None, {"a": a}, {"a": leaf}, x, y)  # type: ignore[arg-type]
        assert seen[-1].device.type == device and seen[-1].shape == (3,)
        assert leaf.grad is not None and leaf.grad.device.type == device
        if device == "cpu":
            assert seen[-1].tolist() == [1.0, 1.0, 1.0]
            assert float(loss) == 1.5 and leaf.grad.tolist() == [2.0, -6.0]


def test_the_networks_forward_and_loss_inside_an_objective_see_each_clients_side_information() -> None:
    """An ``Objective`` written with ``ctx.forward`` and ``ctx.loss`` (each client's side vector included) trains
    every stacked client as the sequential loop trains it with the same objective (6 samples each in batches of 3:
    no padding rows, which ``ctx.loss``, unlike the objective's per-sample values, would average in)."""
    torch.manual_seed(0)
    net = TinySide()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(6, 4, generator=g) for _ in range(2)]
    ys = [torch.randint(0, 3, (6,), generator=g) for _ in range(2)]
    sides = [torch.randn(2, generator=g) for _ in range(2)]
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=3)
    vctx = VectorizedContext(net, range(2), xs, ys, sides, opt, per_sample_loss_for(3), generators(2), None, 0, 5,
                             [1.0] * 2)  # fmt: skip

    def objective_for(ctx: ClientContext | VectorizedContext) -> Objective:
        def fn(params: Params, x: Tensor, y: Tensor, data: Params) -> Tensor:
            return F.cross_entropy(ctx.forward(params, x), y, reduction="none") + ctx.loss(params, x, y) ** 2

        return Objective(fn)

    expanded = {n: v.expand(2, *v.shape) for n, v in glob.items()}
    out = vctx.sgd(expanded, list(glob), 1, objective=objective_for(vctx))
    for k, g in enumerate(generators(2)):
        seq = client_context(net, xs[k], ys[k], client=k, side=sides[k], optimizer=opt, loss=loss_fn_for(3),
                             generator=g)
        ref = seq.sgd(glob, list(glob), 1, objective=objective_for(seq))
        for n in glob:
            assert_close_finite(out[n][k], ref[n], rtol=1e-5, atol=1e-6, msg=f"{n} client {k}")
    assert not torch.equal(out["side.embed.weight"][0], out["side.embed.weight"][1])


def test_stacked_phases_of_a_relu_net_take_the_gradient_by_hand(monkeypatch) -> None:
    """A ReLU MLP phase (the cross-entropy, no penalty) builds no autograd graph, and each client ends where its own
    minibatch momentum SGD ends (uneven clients: 23 rows in batches of 10, and 7)."""
    calls = {"autograd": 0}
    autograd_grad = torch.autograd.grad

    def counted(*args: object, **kwargs: object) -> tuple:
        calls["autograd"] += 1
        return autograd_grad(*args, **kwargs)

    xs, ys = data(sizes=(23, 7), dim=6)
    net = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    params = stacked_params(net, 2)
    names = list(params)
    tanh = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    with monkeypatch.context() as patch:
        patch.setattr(torch.autograd, "grad", counted)
        got = context_2(net, xs, ys).sgd(params, names, 1)
        assert calls["autograd"] == 0
        context_2(tanh, xs, ys).sgd(params, names, 1)
        assert calls["autograd"] == 3  # a Tanh network: by autograd, one call per step
    assert_each_client_is_its_own_sgd(net, xs, ys, params, names, got, 10, names, rtol=1e-5, atol=1e-6)
