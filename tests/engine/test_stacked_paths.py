"""``fl_lightning/engine/stacked_paths.py``: the run's sub-paths of the stacked path (``plan_stacked``), decided
once by ``executor.decide`` and read by ``VectorizedContext.sgd``: each rule on a network built here, the line that
names them, and that a context steps the way its given plan says (with the same numbers either way)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import fl_lightning.engine.stacked as stacked
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.stacked_paths import StackedPaths, caches_features, conv_clients, plan_stacked, step_form
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import Concat, SplitModel
from tests.engine.test_stacked import Params, check_clients, context_2, data, stacked_params

CPU = torch.device("cpu")
SGD = ClientOptimizer()


def plan(net: nn.Module, device: torch.device = CPU, optimizer: ClientOptimizer = SGD, augment: object = None,
         classification: bool = True, sides: bool = False, **kwargs: object) -> StackedPaths:  # fmt: skip
    return plan_stacked(net, device, optimizer, augment, classification, sides, **kwargs)


class DrawnInside:
    """An augmentation that draws inside its call (no ``draw``/``apply``): it cannot draw ahead."""

    def __call__(self, x: Tensor, g: torch.Generator) -> Tensor:
        return x


class Recurrent(SplitModel):
    def __init__(self) -> None:
        super().__init__(nn.LSTM(4, 3, batch_first=True), nn.Linear(3, 3))


# ---- conv_clients ------------------------------------------------------------------------------------------------
def test_conv_clients_loops_on_the_cpu_and_vmaps_on_other_devices() -> None:
    """``CONV_CLIENTS``: ``loop`` on the CPU; any device type it does not name gets ``vmap``."""
    assert conv_clients(torch.device("cpu")) == "loop"
    assert conv_clients(torch.device("cuda")) == "vmap"
    assert conv_clients(torch.device("meta")) == "vmap"


# ---- plan_stacked ------------------------------------------------------------------------------------------------
def test_a_relu_mlp_with_the_cross_entropy_is_fused_and_its_head_phases_use_cached_features() -> None:
    assert plan(DigitsMLP()) == StackedPaths("fused relu mlp", head="fused relu mlp")
    assert plan(DigitsMLP(), cache_features=False) == StackedPaths("fused relu mlp")
    assert plan(DigitsMLP()).describe() == "fused relu mlp, heads on cached features"
    assert plan(DigitsCNN()).describe() == "conv in turn, heads fused relu mlp on cached features"


def test_other_linear_networks_and_regression_step_with_batched_products() -> None:
    tanh = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3))
    assert plan(tanh) == StackedPaths("batched matmul")  # no body/head split: nothing to cache
    assert plan(DigitsMLP(), classification=False) == StackedPaths("batched matmul", head="batched matmul")
    assert step_form(tanh, classification=True, sides=False) == "batched matmul"
    assert step_form(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), classification=True, sides=False) == "fused relu mlp"


def test_other_networks_and_side_data_are_vmapped() -> None:
    layer_norm = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 3))
    assert plan(layer_norm) == StackedPaths("vmap")
    side = SplitModel(nn.Linear(4, 3), nn.Linear(5, 3), Concat(nn.Linear(2, 2)))
    assert plan(side, sides=True) == StackedPaths("vmap")  # a side branch: no cached features either
    assert plan(DigitsMLP(), sides=True) == StackedPaths("vmap")


def test_convolutions_run_in_turn_on_the_cpu_and_vmapped_elsewhere() -> None:
    assert plan(DigitsCNN()) == StackedPaths("conv in turn", head="fused relu mlp")
    assert plan(DigitsCNN(), torch.device("meta")) == StackedPaths("vmap", head="fused relu mlp")
    assert plan(DigitsCNN(), loop_over_clients=False) == StackedPaths("vmap", head="fused relu mlp")
    assert plan(DigitsMLP(), loop_over_clients=True).sgd == "conv in turn"  # forced (the benchmark compares both)
    assert plan(DigitsCNN(batchnorm=True)) == StackedPaths("conv in turn")  # BatchNorm: no cached features
    assert not caches_features(DigitsCNN(batchnorm=True), sides=False)


def test_what_has_no_batched_form_runs_in_turn_and_says_why() -> None:
    rmsprop = ClientOptimizer(factory=functools.partial(torch.optim.RMSprop, lr=0.1))
    assert plan(DigitsMLP(), optimizer=rmsprop) == StackedPaths("in turn", why="client optimizer RMSprop has no "
                                                                               "batched form")  # fmt: skip
    assert plan(DigitsMLP(), augment=DrawnInside()) == StackedPaths("in turn", why="the augmentation cannot draw ahead")
    recurrent = plan(Recurrent())  # its head phases still train on cached features
    lstm = "recurrent layers (LSTM) have no batched form"
    assert recurrent == StackedPaths("in turn", head="fused relu mlp", why=lstm)
    assert recurrent.describe() == f"in turn: {lstm}, heads fused relu mlp on cached features"


# ---- the context reads its plan ----------------------------------------------------------------------------------
def test_a_context_steps_as_its_given_plan_says_with_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ReLU MLP plans ``fused relu mlp`` (the gradient by hand); given ``vmap`` (as ``executor.decide`` gives a
    run's plan), the context vmaps and never takes the hand-written gradient: the same weights as the reference."""
    xs, ys = data()
    net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3))
    params = stacked_params(net, 2)
    assert context_2(net, xs, ys).sub_paths() == StackedPaths("fused relu mlp")
    calls: list[str] = []
    real_vmap, real_by_hand = stacked.vmap, stacked.relu_net_gradient
    monkeypatch.setattr(stacked, "vmap", lambda *a, **k: (calls.append("vmap"), real_vmap(*a, **k))[1])
    monkeypatch.setattr(stacked, "relu_net_gradient", lambda *a: (calls.append("by hand"), real_by_hand(*a))[1])
    got = {}
    for given in (None, StackedPaths("vmap")):
        calls.clear()
        ctx = context_2(net, xs, ys, paths=given)
        got[given] = ctx.sgd(params, list(params), 2)
        assert set(calls) == ({"by hand"} if given is None else {"vmap"}), given

    def loss(x: Tensor, y: Tensor, k: int) -> Callable[[Params], Tensor]:
        return lambda p: F.cross_entropy(F.relu(x @ p["0.weight"].T + p["0.bias"]) @ p["2.weight"].T + p["2.bias"], y)

    for out in got.values():
        check_clients(out, params, xs, (loss, ys), list(params), 2)


def test_a_context_that_plans_in_turn_says_why_once_unless_the_runs_line_did(caplog: pytest.LogCaptureFixture) -> None:
    """A context built without the run's plan (a test's, the benchmark's) says why its clients run in turn, once per
    network; on a network whose run already said its executor line (``notes.say_once``, key ``executor``) it says
    nothing more: one line per run."""
    from fl_lightning.engine.notes import say_once

    xs, ys = data()
    rmsprop = ClientOptimizer(batch_size=10, factory=functools.partial(torch.optim.RMSprop, lr=0.1))
    said, quiet = SplitModel(nn.Identity(), nn.Linear(4, 3)), SplitModel(nn.Identity(), nn.Linear(4, 3))
    with caplog.at_level("INFO", logger="fl_lightning"):
        say_once(quiet, "executor", 20, "executor: stacked (sgd: in turn: …) because …")
        for net in (said, said, quiet):
            context_2(net, xs, ys, optimizer=rmsprop).sgd(stacked_params(net, 2), ["head.weight", "head.bias"], 1)
    assert [r.getMessage() for r in caplog.records] == [
        "executor: stacked (sgd: in turn: …) because …",
        "vectorized executor: client optimizer RMSprop has no batched form: clients run in turn",
    ]
