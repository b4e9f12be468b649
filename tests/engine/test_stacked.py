"""``fl_lightning/engine/stacked.py`` (the vectorized executor): ``VectorizedContext.sgd``, ``plan_phase``, its
client-by-client paths, rules and state devices, against plain-torch references written here."""

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
from fl_lightning.client import ClientOptimizer, Objective, Penalty, state_name
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for, state_template
from fl_lightning.engine.stacked import (
    BatchedAdam,
    BatchedSGD,
    VectorizedContext,
    _max_pool,
    batched_rule,
    conv_clients,
    per_sample_loss_for,
    plan_phase,
    sequential_forward,
    stack,
    stackable,
    stacked_forward,
    unstack,
)
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import Concat, Mask, SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

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


HYPER = {"weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": True, "maximize": False}


@pytest.mark.parametrize("decoupled", [False, True])
def test_batched_adam_state_is_zero_per_client_and_on_the_parameters_device(decoupled: bool) -> None:
    rule = BatchedAdam(HYPER, decoupled)
    on_meta = rule.init(torch.empty(3, 4, 5, device="meta"))
    assert set(on_meta) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert all(t.device.type == "meta" for t in on_meta.values())
    on_cpu = rule.init(torch.randn(3, 4, 5))
    assert on_cpu["step"].shape == (3,) and not on_cpu["step"].any()  # one step count per client, all at 0
    assert all(t.shape == (3, 4, 5) and not t.any() for k, t in on_cpu.items() if k != "step")


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
        seq = client_context(
            net, xs[k], ys[k], client=k, optimizer=opt, loss=loss_fn_for(10), generator=g, channels_last=True,
        )
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
        seq = client_context(
            net, xs[k], ys[k], client=k, side=sides[k], optimizer=opt, loss=loss_fn_for(3), generator=g,
            channels_last=True,
        )
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


def _steps_each_client_as_its_torch_optimizer(name: str) -> None:
    """The stacked optimiser rule ``RULES[name]``, with client k joining at step k (masked as the executor masks),
    gives each client what its own ``torch.optim`` optimiser gives after its own steps (float64, 1e-12)."""
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


LR = 0.1


Params = dict[str, Tensor]


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
    ctx = context_2(net, xs, ys, loop_over_clients=True)
    got = ctx.sgd(params, ["weight", "bias"], 1, gradient=ones_gradient(["weight", "bias"]))
    for n in params:  # one step of the first (momentum-free) SGD step along the ones
        assert_close_finite(got[n], params[n] - LR, rtol=1e-6, atol=1e-7)


def test_looping_over_clients_adds_the_penalty() -> None:
    xs, ys = data()
    net = nn.Linear(4, 3)
    params = stacked_params(net, 2)
    anchor = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(4))
    pen = Penalty(lambda p, d: ((p["weight"] - d["a"]) ** 2).sum(), {"a": anchor})
    got = context_2(net, xs, ys, loop_over_clients=True).sgd(params, ["weight", "bias"], 2, penalty=pen)

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: linear_loss(x, y)(p) + ((p["weight"] - anchor[k]) ** 2).sum()

    check_clients(got, params, xs, (loss, ys), ["weight", "bias"], 2)


def test_a_looped_client_without_samples_reports_its_loss_on_the_device() -> None:
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(0, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(0, dtype=torch.long, device=meta)]
    net = nn.Linear(4, 3)
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    ctx = context_2(net, xs, ys, loop_over_clients=True)
    ctx.sgd(params, ["weight", "bias"], 1)
    assert ctx.train_loss.device == meta and ctx.train_loss.shape == (2,)


def test_client_by_client_steps_are_counted_on_the_device() -> None:
    meta = torch.device("meta")
    xs = [torch.empty(4, 4, device=meta), torch.empty(3, 4, device=meta)]
    ys = [torch.zeros(4, dtype=torch.long, device=meta), torch.zeros(3, dtype=torch.long, device=meta)]
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    params = {n: torch.empty(2, *p.shape, device=meta) for n, p in net.named_parameters()}
    adagrad = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.Adagrad, lr=LR))
    ctx = context_2(net, xs, ys, optimizer=adagrad)
    ctx.sgd(params, ["head.weight", "head.bias"], 1)
    assert ctx.steps_taken.device == meta and ctx.steps_taken.shape == (2,)


def test_an_optimizer_without_batched_form_is_named_in_the_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    xs, ys = data()
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    adagrad = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.Adagrad, lr=LR))
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        context_2(net, xs, ys, optimizer=adagrad).sgd(stacked_params(net, 2), ["head.weight", "head.bias"], 1)
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


CPU = torch.device("cpu")


class _TwoColumnDraws:
    """An augmentation that draws ahead two integers per sample (its ``apply`` is not used by a plan)."""

    def __call__(self, x: Tensor, g: torch.Generator) -> Tensor:
        return x

    def draw(self, n: int, g: torch.Generator) -> Tensor:
        return torch.randint(0, 100, (n, 2), generator=g)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return x


def test_max_steps_cut_inside_the_second_epoch_with_two_column_draws() -> None:
    """n = 5, batch 2, ``min_batch`` 2: 2 steps an epoch (the last single sample is skipped). ``max_steps`` = 3:
    epoch 1 gives 2 steps, epoch 2 one. Rows are offset by the client's start (10)."""
    g = torch.Generator().manual_seed(7)
    plan = plan_phase([5], [10], [g], [1.0], _TwoColumnDraws(), 2, 2, 2, 3, CPU)
    ref = torch.Generator().manual_seed(7)
    perm1 = torch.randperm(5, generator=ref)
    draw1 = torch.randint(0, 100, (5, 2), generator=ref)
    perm2 = torch.randperm(5, generator=ref)
    draw2 = torch.randint(0, 100, (5, 2), generator=ref)
    assert plan.host_steps == [3] and plan.steps.tolist() == [3]
    assert plan.lengths == [[2, 2, 2]]
    want_rows = [perm1[0:2] + 10, perm1[2:4] + 10, perm2[0:2] + 10]
    assert plan.rows.shape == (3, 1, 2)
    for s in range(3):
        assert plan.rows[s, 0].tolist() == want_rows[s].tolist()
    assert plan.draws is not None and plan.draws.shape == (3, 1, 2, 2)
    want_draws = [draw1[0:2], draw1[2:4], draw2[0:2]]
    for s in range(3):
        assert plan.draws[s, 0].tolist() == want_draws[s].tolist()
    assert torch.equal(g.get_state(), ref.get_state())  # exactly two epochs were drawn


def test_a_straggler_budget_caps_steps_and_draws_no_further_epoch() -> None:
    """Budget 0.5 of 2 epochs of 2 steps (n = 5, batch 2, ``min_batch`` 2) is 2 steps: all in epoch 1, so the
    generator draws one shuffle only."""
    g = torch.Generator().manual_seed(3)
    plan = plan_phase([5], [0], [g], [0.5], None, 2, 2, 2, None, CPU)
    ref = torch.Generator().manual_seed(3)
    perm = torch.randperm(5, generator=ref)
    assert plan.host_steps == [2] and plan.lengths == [[2, 2]] and plan.draws is None
    assert plan.rows[:, 0].tolist() == [perm[0:2].tolist(), perm[2:4].tolist()]
    assert torch.equal(g.get_state(), ref.get_state())


def test_a_straggler_budget_with_a_kept_partial_batch() -> None:
    """``min_batch`` 1: n = 5, batch 2 is 3 steps an epoch; budget 0.5 of 2 epochs is 3 steps (batches 2, 2, 1)."""
    g = torch.Generator().manual_seed(4)
    plan = plan_phase([5], [0], [g], [0.5], None, 2, 2, 1, None, CPU)
    ref = torch.Generator().manual_seed(4)
    perm = torch.randperm(5, generator=ref)
    assert plan.host_steps == [3] and plan.lengths == [[2, 2, 1]]
    assert plan.rows[:, 0].tolist() == [perm[0:2].tolist(), perm[2:4].tolist(), [int(perm[4]), -1]]
    assert torch.equal(g.get_state(), ref.get_state())


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


def test_a_plan_with_a_cap_per_client_and_each_clients_last_epoch() -> None:
    """Sizes 5, 3, 0 in batches of 2 over 2 epochs (3, 2 and 0 batches per epoch), caps 4, none, none: 4, 4 and 0
    steps; the last epoch with a step starts at step 3 (client 0's second epoch has one step), 2, and 0 for the
    client without steps; on the host and on the device."""
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    plan = plan_phase([5, 3, 0], [0, 5, 8], gens, [1.0] * 3, None, 2, 2, 1, [4, None, None], torch.device("cpu"))
    assert plan.host_steps == [4, 4, 0] and plan.steps.tolist() == [4, 4, 0]
    assert plan.host_last_epoch == [3, 2, 0]
    assert plan.last_epoch is not None and plan.last_epoch.tolist() == [3, 2, 0]
    assert plan.lengths == [[2, 2, 1, 2], [2, 1, 2, 1], []]


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


def test_pad_rows_zero_pads_every_client_to_the_longest() -> None:
    from fl_lightning.engine.stacked import pad_rows

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
