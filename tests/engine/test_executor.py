"""``fl_lightning.engine.executor``: the one choice between the sequential loop and the stacked path.

* the decision (``choose_path``): each reason, ``auto`` as the default, the measured CPU threshold, said once
  per run (INFO; a ``vectorized`` that cannot run: the WARNING of its fallback);
* ``auto`` equals the ``sequential`` reference to 1e-5 on short fits (final parameters, client-state bank, every
  logged metric, validation on a carved validation split, test, held-out new clients and "+FT") for every exported
  algorithm that declares ``vectorizable`` (read from ``fl_lightning.algorithms``, so a method that becomes
  vectorizable is covered without touching this file), on an MLP, a small CNN and the CNN with BatchNorm.
"""

from __future__ import annotations

import inspect
import logging
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

import fl_lightning.algorithms as algorithms
from datamodules.augment import CropFlip
from datamodules.base import FederatedDataModule
from datamodules.digits import load_digits_tensors
from fl_lightning.algorithms import L2GD, Algorithm, FedAvg, FedRep, LinearFedAvg
from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine import executor
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.executor import (
    MIN_CONV_MINIBATCHES,
    MIN_STACKED_CLIENTS,
    MIN_TRAINING_RATE,
    Workload,
    auto_rule,
    choose_path,
    minibatches_per_epoch,
    shared_body_applies,
)
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.stacked_paths import StackedPaths
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.engine import test_module as module_tests
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import make_trainer


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """``executor.<name>`` replaced by a wrapper that appends to the returned list at each call."""
    calls: list[int] = []
    original = getattr(executor, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(executor, name, counted)
    return calls


CPU = torch.device("cpu")
BN_NET = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
RMSPROP = ClientOptimizer.from_config(torch.optim.RMSprop)
LSTM_NET = nn.Sequential(nn.LSTM(4, 4))


def _plain_augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An augmentation that draws inside its call (no ``draw``/``apply``)."""
    return x + torch.randn(x.shape, generator=generator)


class _Inherits(FedAvg):
    """Inherits FedAvg's ``vectorizable`` without declaring it (a subclass may change ``client_update``)."""


# ---- the decision ---------------------------------------------------------------------------------------------
MLP = DigitsMLP(hidden=(4,))
ASKED_SEQUENTIAL = ("sequential", "model.executor: sequential", False)
ASKED_VECTORIZED = ("stacked", "model.executor: vectorized", False)
FEDAVG_4 = ("stacked", "FedAvg is vectorizable, 4 clients at a time on the cpu", False)
NOT_MARKED = "_Inherits is not marked vectorizable"
HAS_BN = "the network has BatchNorm layers"
CNN = DigitsCNN()
TINY_CONV = (
    "4 clients at a time on the cpu: its clients take 2 minibatches per epoch on average, and with conv in "
    "turn the loop is faster below 3"
)
CASES = {
    "sequential asked": (FedAvg(1), MLP, CPU, Workload(4), "sequential", ASKED_SEQUENTIAL),
    "vectorized asked": (FedAvg(1), MLP, CPU, Workload(4), "vectorized", ASKED_VECTORIZED),
    "auto stacks": (FedAvg(1), MLP, CPU, Workload(4), "auto", FEDAVG_4),
    "auto, inherited flag": (_Inherits(1), MLP, CPU, Workload(4), "auto", ("sequential", NOT_MARKED, False)),
    "vectorized, inherited flag": (_Inherits(1), MLP, CPU, Workload(4), "vectorized", ("sequential", NOT_MARKED, True)),
    "auto, closed form": (
        LinearFedAvg(), MLP, CPU, Workload(4), "auto", ("sequential", "LinearFedAvg is not marked vectorizable", False)
    ),
    "auto, BatchNorm": (FedAvg(1), BN_NET, CPU, Workload(4), "auto", FEDAVG_4),  # per-client statistics stacked
    "vectorized, BatchNorm": (FedAvg(1), BN_NET, CPU, Workload(4), "vectorized", ASKED_VECTORIZED),
    "auto, optimiser without a batched form": (
        FedAvg(1), MLP, CPU, Workload(4, RMSPROP), "auto",
        ("sequential", "client optimizer RMSprop has no batched form", False),
    ),
    "vectorized, optimiser without a batched form": (
        FedAvg(1), MLP, CPU, Workload(4, RMSPROP), "vectorized", ASKED_VECTORIZED
    ),
    "auto, LSTM": (
        FedAvg(1), LSTM_NET, CPU, Workload(4), "auto",
        ("sequential", "recurrent layers (LSTM) have no batched form", False),
    ),
    "vectorized, LSTM": (FedAvg(1), LSTM_NET, CPU, Workload(4), "vectorized", ASKED_VECTORIZED),
    "evaluation, LSTM": (
        FedAvg(1), LSTM_NET, CPU, Workload(4, evaluation=True), "auto",
        ("stacked", "evaluation, 4 clients at a time on the cpu", False),
    ),
    "auto, augmentation drawn inside": (
        FedAvg(1), MLP, CPU, Workload(4, augment=_plain_augment), "auto",
        ("sequential", "the augmentation cannot draw ahead", False),
    ),
    "auto, augmentation drawn ahead": (FedAvg(1), MLP, CPU, Workload(4, augment=CropFlip()), "auto", FEDAVG_4),
    "auto, momentum SGD": (FedAvg(1), MLP, CPU, Workload(4, ClientOptimizer()), "auto", FEDAVG_4),
    "auto, one client on the cpu": (
        FedAvg(1), MLP, CPU, Workload(1), "auto",
        ("sequential", "1 client at a time on the cpu: the loop is faster below 2", False),
    ),
    "vectorized, one client": (FedAvg(1), MLP, CPU, Workload(1), "vectorized", ASKED_VECTORIZED),
    # L2GD's clients train in 1 − p of the rounds (default p 0.9): below MIN_TRAINING_RATE the loop on the cpu
    "auto, L2GD training in 10% of rounds on the cpu": (
        L2GD(), MLP, CPU, Workload(10), "auto",
        ("sequential", "10 clients at a time on the cpu: L2GD's clients train in 10% of rounds, and the loop is "
         "faster below 75%", False),
    ),
    "auto, L2GD training in 90% of rounds on the cpu": (
        L2GD(p=0.1), MLP, CPU, Workload(10), "auto",
        ("stacked", "L2GD is vectorizable, 10 clients at a time on the cpu", False),
    ),
    "auto, L2GD elsewhere": (
        L2GD(), MLP, "cuda", Workload(10), "auto",
        ("stacked", "L2GD is vectorizable, 10 clients at a time on the cuda", False),
    ),
    "vectorized, L2GD on the cpu": (L2GD(), MLP, CPU, Workload(10), "vectorized", ASKED_VECTORIZED),
    "auto, one client elsewhere": (
        FedAvg(1), MLP, "cuda", Workload(1), "auto",
        ("stacked", "FedAvg is vectorizable, 1 client at a time on the cuda", False),
    ),
    # MIN_CONV_MINIBATCHES: on the cpu a CNN's clients run in turn on the stacked path; with few minibatches the loop
    "auto, tiny conv clients on the cpu": (
        FedAvg(1), CNN, CPU, Workload(4, minibatches=2.0), "auto", ("sequential", TINY_CONV, False)
    ),
    "auto, conv clients of 3 minibatches on the cpu": (FedAvg(1), CNN, CPU, Workload(4, minibatches=3.0), "auto",
                                                       FEDAVG_4),
    "auto, tiny conv clients, FedRep's head on cached features": (
        FedRep(1, 1), CNN, CPU, Workload(4, minibatches=2.0), "auto",
        ("stacked", "FedRep is vectorizable, 4 clients at a time on the cpu", False),
    ),
    "auto, tiny conv clients, FedRep on BatchNorm (no cached features)": (
        FedRep(1, 1), DigitsCNN(batchnorm=True), CPU, Workload(4, minibatches=2.0), "auto",
        ("sequential", TINY_CONV, False),
    ),
    "auto, tiny conv clients elsewhere": (
        FedAvg(1), CNN, "cuda", Workload(4, minibatches=2.0), "auto",
        ("stacked", "FedAvg is vectorizable, 4 clients at a time on the cuda", False),
    ),
    "vectorized, tiny conv clients": (FedAvg(1), CNN, CPU, Workload(4, minibatches=2.0), "vectorized",
                                      ASKED_VECTORIZED),
    "auto, tiny MLP clients": (FedAvg(1), MLP, CPU, Workload(4, minibatches=1.0), "auto", FEDAVG_4),
    "evaluation, tiny conv clients": (
        FedAvg(1), CNN, CPU, Workload(4, evaluation=True, minibatches=1.0), "auto",
        ("stacked", "evaluation, 4 clients at a time on the cpu", False),
    ),
    # evaluation (scoring and "+FT") never runs client_update: the algorithm's flag does not matter, BN does
    "evaluation, inherited flag": (
        _Inherits(1), MLP, CPU, Workload(4, evaluation=True), "auto",
        ("stacked", "evaluation, 4 clients at a time on the cpu", False),
    ),
    "evaluation, BatchNorm": (
        _Inherits(1), BN_NET, CPU, Workload(4, evaluation=True), "auto", ("sequential", HAS_BN, False)
    ),
}  # fmt: skip


def test_each_reason() -> None:
    """Every case of ``CASES`` (one test for all: each case runs under ``make mutation``'s per-function test cap)."""
    for case, (algorithm, net, device, workload, asked, expected) in CASES.items():
        decision = choose_path(algorithm, net, device, workload, asked)
        assert (decision.path, decision.reason, decision.fallback) == expected, case
        assert decision.stacked is (expected[0] == "stacked"), case


def test_the_cpu_threshold_is_the_measured_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``MIN_STACKED_CLIENTS['cpu']`` clients the loop, from it on the stacked path; the rule reads the table."""
    least = MIN_STACKED_CLIENTS["cpu"]
    assert least == 2  # benchmarks/executor_auto.py: 1 client 0.60-0.82, 2 clients 1.21-1.47 (sequential / stacked)
    assert not choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(least - 1)).stacked
    assert choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(least)).stacked
    monkeypatch.setitem(MIN_STACKED_CLIENTS, "cpu", 5)
    assert not choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(4)).stacked
    assert choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(5)).stacked


def test_the_training_rate_threshold_is_the_measured_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``MIN_TRAINING_RATE['cpu']`` of rounds with local training the loop, from it on the stacked path."""
    floor = MIN_TRAINING_RATE["cpu"]
    assert floor == 0.75  # executor_auto --l2gd, seq / stacked: rate 0.1 0.92-0.97, 0.5 0.98-1.02, 0.9 1.05-1.07
    assert not choose_path(L2GD(p=0.5), DigitsMLP(), CPU, Workload(10)).stacked
    assert choose_path(L2GD(p=0.2), DigitsMLP(), CPU, Workload(10)).stacked
    monkeypatch.setitem(MIN_TRAINING_RATE, "cpu", 0.95)
    assert not choose_path(L2GD(p=0.1), DigitsMLP(), CPU, Workload(10)).stacked
    assert choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(10)).stacked  # trains every round
    assert choose_path(L2GD(p=0.9), DigitsMLP(), CPU, Workload(10, evaluation=True)).stacked  # nothing trains


def test_auto_rule_picks_the_loop_for_a_lone_tiny_client_and_stacks_a_large_cohort() -> None:
    """The rule itself: one client at a time on the cpu (the measured 0.6-0.9x of the stacked path), or clients that
    rarely train, get the loop with the reason the decision's line prints; a cohort of 10 training every round, or
    any cohort on another device, stacks."""
    assert auto_rule("cpu", 1, FedAvg(1)) == "the loop is faster below 2"
    assert auto_rule("cpu", 10, FedAvg(1)) is None and auto_rule("cpu", 10, None) is None
    assert auto_rule("cpu", 10, L2GD()) == "L2GD's clients train in 10% of rounds, and the loop is faster below 75%"
    assert auto_rule("cuda", 1, L2GD()) is None
    decision = choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(1))
    assert decision.reason == "1 client at a time on the cpu: the loop is faster below 2"


def test_the_conv_minibatch_floor_is_the_measured_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``MIN_CONV_MINIBATCHES['cpu']`` minibatches per epoch a CNN's clients take the loop on the cpu; the rule
    reads the table, and does not apply without the count, to an MLP, or to evaluation."""
    fewest = MIN_CONV_MINIBATCHES["cpu"]
    assert fewest == 3  # executor_auto --conv, seq / stacked: 1 and 2 minibatches below 1 for most methods
    assert not choose_path(FedAvg(1), DigitsCNN(), CPU, Workload(10, minibatches=fewest - 0.5)).stacked
    assert choose_path(FedAvg(1), DigitsCNN(), CPU, Workload(10, minibatches=fewest)).stacked
    assert choose_path(FedAvg(1), DigitsCNN(), CPU, Workload(10)).stacked  # not known: the stacked path
    monkeypatch.setitem(MIN_CONV_MINIBATCHES, "cpu", 5.0)
    assert not choose_path(FedAvg(1), DigitsCNN(), CPU, Workload(10, minibatches=4.5)).stacked
    assert choose_path(FedAvg(1), DigitsCNN(), CPU, Workload(10, minibatches=5.0)).stacked
    assert choose_path(FedAvg(1), DigitsMLP(), CPU, Workload(10, minibatches=1.0)).stacked  # no conv in turn
    assert auto_rule("cpu", 10, FedAvg(1), 4.5, DigitsCNN()) == (
        "its clients take 4.5 minibatches per epoch on average, and with conv in turn the loop is faster below 5"
    )
    assert auto_rule("cpu", 10, None, 1.0, DigitsCNN()) is None  # evaluation: nothing trains
    assert auto_rule("cuda", 10, FedAvg(1), 1.0, DigitsCNN()) is None  # convolutions vmapped there


def test_minibatches_per_epoch_counts_each_clients_partial_batch_unless_dropped() -> None:
    offsets = [0, 18, 23, 53, 53]  # clients of 18, 5, 30 and 0 samples
    assert minibatches_per_epoch(offsets, 10) == pytest.approx((2 + 1 + 3 + 0) / 4)
    assert minibatches_per_epoch(offsets, 10, drop_last=True) == pytest.approx((1 + 0 + 3 + 0) / 4)
    assert minibatches_per_epoch(offsets, 4) == pytest.approx((5 + 2 + 8 + 0) / 4)
    assert minibatches_per_epoch([0], 10) == 0.0


def test_decide_counts_the_runs_minibatches_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """TinyDigits' clients hold 18 training samples: 2 minibatches of 10, so a CNN run's FedAvg takes the loop on the
    cpu, FedRep (head on cached features) the stacked path; the count is made once per run."""
    counted = _count_calls(monkeypatch, "minibatches_per_epoch")
    dm = TinyDigits()
    dm.setup()  # carves the validation quarter: 18 training samples per client
    module = FederatedModule(FedAvg(1), DigitsCNN())
    module.attach_data(dm.federated)
    module._trainer = SimpleNamespace(datamodule=dm, world_size=1)
    decisions = [executor.decide(module, PER_ROUND) for _ in range(3)]
    assert len(counted) == 1
    assert decisions[0].path == "sequential" and "take 2 minibatches per epoch" in decisions[0].reason
    rep = FederatedModule(FedRep(1, 1), DigitsCNN())
    rep.attach_data(dm.federated)
    rep._trainer = SimpleNamespace(datamodule=dm, world_size=1)
    assert executor.decide(rep, PER_ROUND).path == "stacked"


def test_fedrep_declares_its_head_phase_only_when_it_trains_the_head() -> None:
    assert FedRep().head_only_phase and not FedRep(head_epochs=0).head_only_phase
    assert not FedRep(personal=("body.",)).head_only_phase and not Algorithm.head_only_phase


def test_local_training_rate_is_the_methods_own_coin() -> None:
    assert FedAvg(1).local_training_rate == 1.0 and Algorithm.local_training_rate == 1.0
    assert L2GD(p=0.9).local_training_rate == pytest.approx(0.1) and L2GD(p=0.25).local_training_rate == 0.75


def test_auto_is_the_default() -> None:
    assert inspect.signature(FederatedModule.__init__).parameters["executor"].default == "auto"
    assert FederatedModule(FedAvg(1), DigitsMLP()).executor == "auto"


# ---- shared_body_applies ---------------------------------------------------------------------------------------
class _BodyHeadOnly(nn.Module):
    """A network with ``body`` and ``head`` and no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 2), nn.Linear(2, 2)


def _module_2(net: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(executor="vectorized", net=net, algorithm=FedAvg(1, personal=("head.",)))


def test_shared_body_applies_with_head_fine_tuning_and_not_with_body_fine_tuning() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    assert shared_body_applies(module, None)
    assert shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("body.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("head.", "body.")))


def test_shared_body_applies_not_with_a_side_branch() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2), side=nn.Identity()))
    assert not shared_body_applies(module, None)


def test_shared_body_applies_to_a_network_without_a_side_attribute() -> None:
    assert shared_body_applies(_module_2(_BodyHeadOnly()), None)


def test_global_model_methods_with_server_or_client_state_evaluate_with_the_shared_body() -> None:
    """SCAFFOLD, FedDyn and MOON evaluate every client with the global model (their client state is kept under
    their own prefixes): the shared-body path applies to them, "+FT" of the head included."""
    from fl_lightning.algorithms import MOON, SCAFFOLD, FedDyn

    for algorithm in (SCAFFOLD(1), FedDyn(1), MOON(1)):
        module = SimpleNamespace(executor="vectorized", net=SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)),
                                 algorithm=algorithm)  # fmt: skip
        assert shared_body_applies(module, None), type(algorithm).__name__
        assert shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",))), type(algorithm).__name__
        glob, state = {"head.weight": torch.ones(2, 2)}, {"x.head.weight": torch.zeros(2, 2)}
        used = algorithm.client_model(glob, state)
        assert list(used) == ["head.weight"] and used["head.weight"] is glob["head.weight"]


def test_shared_body_applies_only_to_the_vectorized_executor() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    module.executor = "sequential"
    assert not shared_body_applies(module, None)


# ---- a tiny federation ------------------------------------------------------------------------------------------
TRAIN, TEST, CLIENTS, NEW, PER_ROUND, ROUNDS = 24, 8, 4, 2, 3, 2


class TinyDigits(FederatedDataModule):
    """The first digits images: 4 clients with 24 training (a quarter carved for validation) and 8 test images
    each, and 2 held-out new clients."""

    def __init__(self) -> None:
        super().__init__(CLIENTS, clients_per_round=PER_ROUND, seed=0, val_fraction=0.25)
        self.new_clients: FederatedData | None = None

    def _part(self, x: torch.Tensor, y: torch.Tensor, start: int, clients: int) -> FederatedData:
        train = [np.arange(start + c * TRAIN, start + (c + 1) * TRAIN) for c in range(clients)]
        first_test = start + clients * TRAIN
        test = [np.arange(first_test + c * TEST, first_test + (c + 1) * TEST) for c in range(clients)]
        return self.make_federated(x, y, train, x, y, test, num_classes=10)

    def build(self) -> FederatedData:
        x, y = load_digits_tensors()
        self.new_clients = self._part(x, y, CLIENTS * (TRAIN + TEST), NEW)
        return self._part(x, y, 0, CLIENTS)


def _vectorizable() -> list[str]:
    """The exported algorithm classes that declare ``vectorizable`` themselves (gradient methods written with
    ``ctx.sgd``; closed-form and clustering methods do not declare it)."""
    names = []
    for name in algorithms.__all__:
        cls = getattr(algorithms, name)
        if isinstance(cls, type) and issubclass(cls, Algorithm) and cls.__dict__.get("vectorizable", False):
            names.append(name)
    return names


NETWORKS = {"mlp": lambda: DigitsMLP(hidden=(16,)), "cnn": DigitsCNN, "cnn_bn": lambda: DigitsCNN(batchnorm=True)}


# fewer local steps where a default would repeat the same code path many times (PFedMe: 20 local steps x 5 inner
# steps; FedRep: 10 head epochs); 3 and 2 still run each loop more than once and wrap past an epoch of 18 samples
SMALL: dict[str, dict[str, int]] = {"PFedMe": {"local_steps": 3}, "FedRep": {"head_epochs": 2}}


def _fit(name: str, network: str, asked: str, accelerator: str = "cpu") -> dict[str, Any]:
    cls = getattr(algorithms, name)
    L.seed_everything(0, verbose=False)
    module = FederatedModule(
        cls(**SMALL.get(name, {})), NETWORKS[network](), eval_every=1, eval_last=2, finetune=FineTune(1),
        new_client_finetune=FineTune(1), executor=asked,
        aggregation="uniform" if cls.needs_uniform_aggregation else "num_samples",
    )  # fmt: skip
    dm = TinyDigits()
    trainer = make_trainer(ROUNDS, accelerator=accelerator)
    trainer.fit(module, datamodule=dm)
    fitted = {k: float(v) for k, v in trainer.callback_metrics.items()}
    tested = trainer.test(module, datamodule=dm, verbose=False)[0]
    return {"module": module, "fit": fitted, "test": tested}


@pytest.mark.parametrize(
    "network", ["mlp", *(pytest.param(n, marks=pytest.mark.slow) for n in NETWORKS if n != "mlp")]
)  # a CNN fit pair takes a few seconds on 2 cores
@pytest.mark.parametrize("name", _vectorizable())
def test_auto_equals_sequential(name: str, network: str, caplog: pytest.LogCaptureFixture) -> None:
    _auto_equals_sequential(name, network, caplog, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("network", list(NETWORKS))
@pytest.mark.parametrize("name", _vectorizable())
def test_auto_equals_sequential_on_cuda(name: str, network: str, caplog: pytest.LogCaptureFixture) -> None:
    """The same equality on a GPU, where ``auto`` stacks every cohort. TF32 off: it rounds products to 10 mantissa
    bits (~1e-3), which would hide what the test is for, the stacking's own error. The BatchNorm CNN compares with
    cuDNN off: on an H200, after 2 rounds with cuDNN, the two paths differed by up to 4e-5 in conv weights (14
    methods) and 5.1e-4 in FedProto's test loss (relative 1.3e-4), because cuDNN's kernels for one client and the
    stacked path's reductions sum in different orders and BatchNorm divides that by a channel's small batch
    deviation; with cuDNN off all 19 methods agreed to 1e-5 (and so does every other network with it on)."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.enabled
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.enabled = network != "cnn_bn"
    try:
        _auto_equals_sequential(name, network, caplog, "gpu")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.enabled = flags


def _auto_equals_sequential(name: str, network: str, caplog: pytest.LogCaptureFixture, accelerator: str) -> None:
    try:
        reference = _fit(name, network, "sequential", accelerator)
    except ConfigError as exc:  # the method does not run on this network (said on the reference path)
        pytest.skip(f"{name} on {network}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        auto = _fit(name, network, "auto", accelerator)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("executor: ")]
    assert len(said) == 1, said
    if accelerator == "cpu" and "the loop is faster" in said[0]:  # auto_rule (L2GD's training rate, a CNN's 2
        assert said[0].startswith("executor: sequential ("), said  # minibatches): the loop, so compare the stacked
        auto = _fit(name, network, "vectorized", accelerator)  # path directly
    else:
        assert said[0].startswith("executor: stacked ("), said  # BatchNorm networks too (per-client statistics)
    seq, fast = reference["module"], auto["module"]
    for n, p in seq.net.named_parameters():
        assert_close_finite(dict(fast.net.named_parameters())[n], p, rtol=1e-5, atol=1e-5, msg=n)
    for n, b in seq.net.named_buffers():
        assert torch.allclose(dict(fast.net.named_buffers())[n].float(), b.float(), rtol=1e-5, atol=1e-5), n
    assert seq.bank.names == fast.bank.names
    for n in seq.bank.names:
        assert torch.allclose(fast.bank.row(n).float(), seq.bank.row(n).float(), rtol=1e-5, atol=1e-5), n
    assert len(seq.history) == len(fast.history) == ROUNDS
    assert {"val/acc_mean", "val/loss"} <= set(seq.history[0])  # the carved validation split was evaluated
    for a, b in zip(seq.history, fast.history):
        assert a.keys() == b.keys()
        assert_close_finite([b[k] for k in a], [a[k] for k in a], rtol=1e-5, atol=1e-5)
    for part in ("fit", "test"):
        assert reference[part].keys() == auto[part].keys()
        keys = sorted(reference[part])
        assert_close_finite([auto[part][k] for k in keys], [reference[part][k] for k in keys], rtol=1e-5, atol=1e-5)
    assert {"test/acc_mean", "test/acc_ft", "test/new_clients_acc"} <= set(reference["test"])
    summary_keys = ("final", "last10", "best", "final_ft", "new_clients_acc", "upload_bytes")
    assert_close_finite([fast.summary[k] for k in summary_keys], [seq.summary[k] for k in summary_keys], rtol=1e-5,
                        atol=1e-5)  # fmt: skip


# ---- said once ----------------------------------------------------------------------------------------------------
def _said(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fl_lightning" and r.levelno == level]


def _short_fit(module: FederatedModule) -> FederatedModule:
    L.seed_everything(0, verbose=False)
    dm = TinyDigits()
    make_trainer(ROUNDS, limit_val_batches=0).fit(module, datamodule=dm)
    return module


def test_the_choice_is_said_once_per_run_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        _short_fit(FederatedModule(FedRep(1, 1), DigitsMLP(hidden=(16,))))
    assert [m for m in _said(caplog, logging.INFO) if m.startswith("executor")] == [
        f"executor: stacked (sgd: fused relu mlp, heads on cached features; eval: shared body) because FedRep is "
        f"vectorizable, {PER_ROUND} clients at a time on the cpu"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        _short_fit(FederatedModule(FedRep(1, 1), DigitsMLP(hidden=(16,)), executor="sequential"))
    assert [m for m in _said(caplog, logging.INFO) if m.startswith("executor")] == [
        "executor: sequential (eval: loop) because model.executor: sequential"
    ]


def test_vectorized_that_cannot_run_warns_once_and_runs_the_loop(caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    stacked = _count_calls(monkeypatch, "vector_context")
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        _short_fit(FederatedModule(_Inherits(1), DigitsMLP(hidden=(16,)), executor="vectorized"))
    assert _said(caplog, logging.WARNING) == [f"executor 'vectorized' falls back to 'sequential': {NOT_MARKED}"]
    assert not [m for m in _said(caplog, logging.INFO) if m.startswith("executor")]
    assert len(stacked) == 0


def test_the_cohort_size_decides_for_the_whole_run_whatever_drops_out() -> None:
    """With a DataModule the decision reads its ``clients_per_round`` (this rank's share), not the survivors."""
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(16,)))
    module.attach_data(TinyDigits().build())
    assert executor.decide(module, 1).path == "sequential"  # no trainer: the clients at hand
    module._trainer = SimpleNamespace(datamodule=TinyDigits(), world_size=1)
    assert executor.decide(module, 1).path == "stacked"  # 3 per round planned, 1 survived
    module._trainer.world_size = 3
    assert executor.decide(module, 3).path == "sequential"  # 1 per rank


def test_planned_clients_is_this_ranks_share_of_the_configured_cohort() -> None:
    """⌈clients_per_round / world size⌉ when the trainer has a DataModule (a trainer that says no world size is one
    process), else the clients given; a module without a trainer plans the clients given."""
    module = SimpleNamespace()
    assert executor.planned_clients(module, 3) == 3
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(clients_per_round=5))
    assert executor.planned_clients(module, 3) == 5
    module._trainer.world_size = 2
    assert executor.planned_clients(module, 3) == 3
    module._trainer.world_size = 5
    assert executor.planned_clients(module, 2) == 1
    module._trainer.datamodule = None
    assert executor.planned_clients(module, 2) == 2


# ---- decide, the contexts and the round's clients ---------------------------------------------------------------
def _tiny_module(**kwargs: Any) -> FederatedModule:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **kwargs)
    module.attach_data(TinyDigits().build())
    return module


def test_decide_reads_the_datas_augmentation_and_the_rounds_client_optimizer() -> None:
    """``decide`` asks ``choose_path`` about the data's augmentation and the round's client optimiser: one that
    cannot draw ahead, or an optimiser without a batched form, runs the loop (3 clients would stack)."""
    assert executor.decide(_tiny_module(), 3) == choose_path(FedAvg(1), MLP, CPU, Workload(3))
    drawn_inside = _tiny_module()
    drawn_inside.fed.augment = _plain_augment
    assert executor.decide(drawn_inside, 3).reason == "the augmentation cannot draw ahead"
    rmsprop = _tiny_module(client_optimizer=torch.optim.RMSprop)
    assert executor.decide(rmsprop, 3).reason == "client optimizer RMSprop has no batched form"


def test_decide_says_its_choice_once_per_run_and_records_it(caplog: pytest.LogCaptureFixture) -> None:
    """The first ``decide`` of a run says its path and records it (``decided``); the next says nothing; another run
    of the same process says its own (a runner's second run, a batched job's last run)."""
    first, second = _tiny_module(), _tiny_module(executor="sequential")
    assert executor.decided(first) is None
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        executor.decide(first, 3)
        executor.decide(first, 3)
        executor.decide(second, 3)
    said = [m for m in _said(caplog, logging.INFO) if m.startswith("executor")]
    assert said == ["executor: stacked (sgd: fused relu mlp, heads on cached features; eval: shared body) because "
                    "FedAvg is vectorizable, 3 clients at a time on the cpu",
                    "executor: sequential (eval: loop) because model.executor: sequential"]  # fmt: skip
    assert executor.decided(first).path == "stacked" and executor.decided(second).path == "sequential"


def test_the_decision_carries_the_runs_sub_paths_and_records_what_its_line_says() -> None:
    """``decide`` fills in how the stacked path trains (a ReLU MLP with the cross-entropy: by hand, heads on cached
    features), how the periodic evaluation scores and how "+FT" does (whole-model "+FT": client by client; head
    only: the shared body); ``record`` (``summary.json``'s ``ran``) carries what ``describe`` (the line) names."""
    whole = executor.decide(_tiny_module(finetune=FineTune(1)), 3)
    assert whole.paths == StackedPaths("fused relu mlp", head="fused relu mlp")
    assert (whole.evaluation, whole.finetune) == ("shared body", "loop")
    assert whole.record() == {"executor": "stacked", "reason": "FedAvg is vectorizable, 3 clients at a time on the cpu",
                              "sgd": "fused relu mlp, heads on cached features", "eval": "shared body",
                              "finetune": "loop"}  # fmt: skip
    assert whole.describe() == ("executor: stacked (sgd: fused relu mlp, heads on cached features; eval: shared body;"
                                " +FT: loop) because FedAvg is vectorizable, 3 clients at a time on the cpu")
    head = executor.decide(_tiny_module(finetune=FineTune.head_only(1)), 3)
    assert head.finetune == "shared body"
    loop = executor.decide(_tiny_module(executor="sequential"), 3)
    assert loop.paths is None and loop.record()["sgd"] is None and loop.evaluation == "loop"
    rmsprop = executor.decide(_tiny_module(client_optimizer=torch.optim.RMSprop, executor="vectorized"), 3)
    assert rmsprop.paths == StackedPaths("in turn", why="client optimizer RMSprop has no batched form")


def test_evaluation_reads_the_runs_decided_path_and_decides_another_fine_tuning_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After ``decide``, the periodic evaluation and the run's "+FT" take the decided path without asking again; a
    fine-tuning the decision did not plan (new clients') is decided when asked (``evaluation_path``), as is an
    evaluation before the run's first round."""
    tune = FineTune.head_only(1)
    module = _tiny_module(finetune=tune)
    assert executor.evaluation_route(module, None, 3) == "shared body"  # not decided yet: asked now
    executor.decide(module, 3)
    asked: list[object] = []
    real = executor.evaluation_path
    monkeypatch.setattr(executor, "evaluation_path", lambda m, ft, n, fed: (asked.append(ft), real(m, ft, n, fed))[1])
    assert executor.evaluation_route(module, None, 1) == "shared body"  # the run's: not re-derived for 1 client
    assert executor.evaluation_route(module, tune, 7) == "shared body"
    assert asked == []
    other = FineTune(1)
    assert executor.evaluation_route(module, other, 3) == "loop" and asked == [other]


@pytest.mark.parametrize("executor_name", ["sequential", "vectorized", "auto"])
def test_the_batchnorm1d_skip_is_said_once_per_run_on_every_path(
    executor_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A BatchNorm1d network whose batches leave some client 1 sample is told once per run, whichever path trains
    it; with ``drop_last``, or batches that leave no client 1 sample, nothing is said."""
    bn_net = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.BatchNorm1d(4))  # noqa: E731
    offsets = [0, 7, 12]  # two clients: 7 and 5 samples
    assert executor.partial_batchnorm_batches(bn_net(), ClientOptimizer(batch_size=3), offsets)  # 7 = 2·3 + 1
    assert executor.partial_batchnorm_batches(bn_net(), ClientOptimizer(batch_size=4), offsets)  # 5 = 4 + 1
    assert not executor.partial_batchnorm_batches(bn_net(), ClientOptimizer(batch_size=5), offsets)  # 7 = 5 + 2
    assert not executor.partial_batchnorm_batches(bn_net(), ClientOptimizer(batch_size=3, drop_last=True), offsets)
    assert not executor.partial_batchnorm_batches(nn.Linear(64, 4), ClientOptimizer(batch_size=3), offsets)

    def module(batch_size: int) -> FederatedModule:
        from tests.engine.test_drop_last_and_summary import BNMLP

        run = FederatedModule(FedAvg(1), BNMLP(), executor=executor_name, batch_size=batch_size)
        run.attach_data(TinyDigits().build())
        return run

    sizes = module(2).fed.train.host_sizes(range(CLIENTS))
    ones = next(b for b in range(2, 40) if any(n % b == 1 for n in sizes))
    none = next(b for b in range(2, 40) if all(n % b != 1 for n in sizes))
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        for batch in (ones, ones, none):
            run = module(batch)
            executor.decide(run, 3)
            executor.decide(run, 3)
    said = [m for m in _said(caplog, logging.WARNING) if "1 sample is skipped" in m]
    assert len(said) == 2  # once for each of the two runs whose batches leave a client 1 sample


def test_vector_context_stacks_the_chosen_clients_rows_side_data_and_augmentation() -> None:
    """``vector_context`` builds the stacked context of the given clients in their order: their training rows, their
    side vectors, the data's augmentation, the round, seed and budgets."""
    module = _tiny_module()
    module.fed.side = torch.arange(CLIENTS * 2, dtype=torch.float32).view(CLIENTS, 2)
    module.fed.augment = CropFlip()
    ctx = executor.vector_context(module, [2, 0], 5, [1.0, 0.5])
    assert ctx.clients == [2, 0] and ctx.round == 5 and ctx.seed == module.fed.seed and ctx.step_budgets == [1.0, 0.5]
    for k, c in enumerate([2, 0]):
        x, y = module.fed.train.client(c)
        assert torch.equal(ctx.xs[k], x) and torch.equal(ctx.ys[k], y)
    assert torch.equal(ctx.sides, module.fed.side[[2, 0]])
    assert ctx.augment is module.fed.augment
    for k, c in enumerate([2, 0]):  # each client's own stream (seed, "train", round, client)
        expected = torch.rand(3, generator=make_generator(module.fed.seed, "train", 5, c))
        assert torch.equal(torch.rand(3, generator=ctx.generators[k]), expected)
    out, y = torch.randn(4, 10, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 0, 9, 3])
    assert_close_finite(ctx.per_sample_loss(out, y), -torch.log_softmax(out, 1)[torch.arange(4), y])


def test_stacked_updates_are_the_rows_lo_to_hi() -> None:
    """Rows ``lo:hi`` of a stacked update, one ``ClientUpdate`` per row: upload, state with the kept rows merged,
    the client's size and loss."""
    upd = ClientUpdate({"w": torch.arange(8.0).view(4, 2)}, {"s": torch.arange(4.0)}, 4, torch.tensor([0.0, 1, 2, 3]))
    ctx = SimpleNamespace(num_samples=[5, 6, 7, 8])
    kept = {"client_optimizer.steps.w": torch.tensor([1, 2, 3, 4])}
    got = executor.stacked_updates(upd, ctx, kept, 1, 3)
    assert len(got) == 2
    for u, k in zip(got, (1, 2)):
        assert torch.equal(u.upload["w"], torch.tensor([2.0 * k, 2.0 * k + 1]))
        assert u.state == {"s": float(k), "client_optimizer.steps.w": k + 1}
        assert (u.num_samples, float(u.loss)) == (5 + k, float(k))


def test_run_clients_of_a_module_without_trainer_stack_its_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a trainer the clients at hand decide: 3 clients of a vectorizable method stack, with the updates of
    the sequential loop."""
    glob = {n: p.detach().clone() for n, p in _tiny_module().net.named_parameters()}
    seq, auto = _tiny_module(executor="sequential"), _tiny_module()
    auto.net.load_state_dict(seq.net.state_dict())
    want = executor.run_clients(seq, [0, 1, 2], 0, glob, [{}, {}, {}], [1.0] * 3)
    stacked = _count_calls(monkeypatch, "vector_context")
    got = executor.run_clients(auto, [0, 1, 2], 0, glob, [{}, {}, {}], [1.0] * 3)
    assert len(stacked) == 1
    for a, b in zip(got, want):
        assert a.num_samples == b.num_samples
        for n in b.upload:
            assert_close_finite(a.upload[n], b.upload[n], rtol=1e-5, atol=1e-6, msg=n)


def test_run_clients_passes_kept_state_through_the_stacked_context() -> None:
    """The stacked case of ``tests/engine/test_module.py``'s kept-state test, as a test of its own (``make
    mutation`` runs the fastest case of a parametrized test only)."""
    module_tests.test_kept_optimizer_state_goes_in_through_the_context_and_comes_back_in_the_state("vectorized")


# ---- the head-only phase a method declares (auto_rule reads it up front) -----------------------------------------
def _head_only_phases(name: str) -> bool:
    """Whether the algorithm's ``client_update`` (its defaults) ran a phase that trains only ``head.`` parameters with
    a plain ``sgd`` (no gradient, no objective), the phase ``VectorizedContext.sgd`` trains on cached features: the
    first round in which 2 TinyDigits clients train on the loop, every ``sgd`` call recorded."""
    from fl_lightning.engine.sequential import ClientContext

    seen: list[bool] = []
    original = ClientContext.sgd

    def recording(self: ClientContext, params: Any, trainable: Any, epochs: int, *args: Any, **kwargs: Any) -> Any:
        names = list(trainable)
        plain = kwargs.get("gradient") is None and kwargs.get("objective") is None
        seen.append(bool(names) and epochs > 0 and plain and all(n.startswith("head.") for n in names))
        return original(self, params, trainable, epochs, *args, **kwargs)

    cls = getattr(algorithms, name)
    fed = TinyDigits().build()
    for net in (DigitsMLP(hidden=(16,)), DigitsCNN(batchnorm=True)):  # FedBN needs BatchNorm
        module = FederatedModule(cls(), net, executor="sequential",
                                 aggregation="uniform" if cls.needs_uniform_aggregation else "num_samples")  # fmt: skip
        try:
            module.attach_data(fed)
        except ConfigError:
            continue
        glob = module.global_params()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ClientContext, "sgd", recording)
            for r in range(50):  # until the clients train (L2GD's clients train in 1 − p of rounds)
                module.run_clients([0, 1], r, glob, [module.bank.get(c) for c in (0, 1)], [1.0, 1.0])
                if seen:
                    break
        assert seen, name  # every vectorizable method trains with sgd
        return any(seen)
    raise AssertionError(f"{name} ran on no test network")


@pytest.mark.parametrize("name", _vectorizable())
def test_head_only_phase_is_declared_by_the_methods_that_run_one(name: str) -> None:
    """``Algorithm.head_only_phase`` (``auto_rule`` reads it up front) against the phases ``client_update`` runs."""
    assert getattr(algorithms, name)().head_only_phase is _head_only_phases(name)
