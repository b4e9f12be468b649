"""``fl_lightning/engine/stacked_in_turn.py``: the stacked path's clients in turn (``conv in turn``: plain autograd
with torch's fused SGD on the phase plan's batches; ``in turn``: ``ClientContext.sgd`` per client), each client's
weights, losses and steps against plain-torch references and the sequential loop, bit for bit."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer, Penalty
from fl_lightning.engine.sequential import ClientContext, loss_fn_for
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import per_sample_loss_for, unstack
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.engine.test_stacked import (
    CL,
    LR,
    SIZES,
    Params,
    TinySide,
    check_clients,
    context_2,
    data,
    generators,
    images,
    linear_loss,
    ones_gradient,
    side_data,
    stacked_params,
)
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context


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


# ---- client-by-client paths ------------------------------------------------------------------------------------
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
