"""``fl_lightning/engine/module.py``: ``FederatedModule``'s defaults, data attachment, the round (``run_clients``,
``training_step``), evaluation bookkeeping, logging and checkpoint hooks, driven directly or through a short fit.
The settings checks are in ``test_settings.py``, the run summary in ``test_summary.py``, checkpoint identity in
``test_checkpoint.py``, the validation metric names in ``test_evaluation.py``; shared builders in
``tests/helpers/small_modules.py``."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn

from datamodules import DigitsDataModule, Shards, SyntheticLinearDataModule
from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import ClientOptimizer, Params
from fl_lightning.engine import aggregation, evaluation
from fl_lightning.engine.aggregation import RoundStats
from fl_lightning.engine.checkpoint import identity
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.executor import client_context, decide, simulate_faults
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.sequential import ClientContext, steps_per_epoch
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import PerClientScores
from fl_lightning.models import DigitsMLP, LinearRepresentation
from fl_lightning.models.split import Concat, SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.digits_runs import digits
from tests.helpers.small_modules import (
    DIGITS,
    FEDAVG,
    digits_fed,
    digits_fed_2,
    fedrep,
    make_module,
)
from tests.helpers.stand_ins import Recorder, with_trainer
from tests.helpers.training import fit, make_trainer


def test_non_sampled_clients_personal_state_is_bit_identical():
    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 1:
                self.before = {n: module.bank.row(n).clone() for n in module.bank.names}
                self.cohort = set(batch["clients"].tolist())

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.after = {n: module.bank.row(n).clone() for n in module.bank.names}

    snap = Snapshot()
    module = FederatedModule(FedRep(head_epochs=2, body_epochs=1), DigitsMLP(), eval_every=100)
    fit(module, digits(), rounds=2, callbacks=[snap])
    for c in range(20):
        same = all(torch.equal(snap.before[n][c], snap.after[n][c]) for n in snap.before)
        assert same == (c not in snap.cohort), c


def test_federated_module_defaults() -> None:
    """The defaults as the module keeps them (client optimiser, aggregation, executor, server SGD, …)."""
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    assert module.client_optimizer == ClientOptimizer(0.01, 0.5, 0.0, 10, True, None)
    assert (module.aggregation, module.executor, module.eval_last) == ("num_samples", "auto", 10)
    assert module.keep_client_optimizer_state is False
    rounds = module.round_optimizers
    assert (rounds.server_lr, rounds.server_momentum) == (1.0, 0.0)


def test_steps_per_epoch_default_steps_on_a_last_single_sample_batch() -> None:
    """9 samples in batches of 4: 4, 4, 1 — three steps by default, two when ``min_batch`` is 2."""
    assert steps_per_epoch(9, 4) == 3
    assert steps_per_epoch(9, 4, 2) == 2
    assert steps_per_epoch(8, 4) == 2


def _mean_client_accuracy(net: torch.nn.Module, split) -> float:
    accs = []
    with torch.no_grad():
        for c in range(split.num_clients):
            x, y = split.client(c)
            if len(y):
                accs.append(float((net(x.to(torch.float64)).argmax(-1) == y).double().mean()))
    return sum(accs) / len(accs)


def test_test_in_64_bit_precision_casts_the_data_and_scores_each_client() -> None:
    """``precision: 64-true`` without a fit: the float32 client data are cast to float64 for testing, and
    ``test/acc_mean`` is the mean over clients of the float64 network's accuracy on each client's test rows."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    (tested,) = make_trainer(1, precision="64-true").test(module, datamodule=dm, verbose=False)
    assert next(module.net.parameters()).dtype == torch.float64
    expected = _mean_client_accuracy(module.net, dm.federated.test)
    assert_close_finite(tested["test/acc_mean"], expected, rtol=1e-6, atol=1e-7)


class _NoisyAdapt(FedAvg):
    """FedAvg whose evaluation adapts each client's model by noise drawn from the client's evaluation generator
    (seeded from the round), so the evaluation depends on which round it is said to be."""

    def adapt_for_evaluation(self, ctx: ClientContext, params: Params) -> Params:
        out = dict(params)
        for n in ("head.bias",):
            out[n] = params[n] + 2.0 * torch.randn(params[n].shape, generator=ctx.generator).to(params[n])
        return out


def test_test_after_fit_repeats_the_last_rounds_evaluation_and_finetune() -> None:
    """Right after a 2-round fit (no validation split, so validation reads the test split), ``trainer.test``
    gives the last validation's accuracy and loss, and its ``test/acc_ft`` is the run's "+FT" result, for round 1."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(
        _NoisyAdapt(1),
        DigitsMLP(hidden=(8,)),
        batch_size=5,
        finetune=FineTune(epochs=1),
        executor="sequential",
        eval_last=1,
    )
    trainer = make_trainer(2)
    trainer.fit(module, datamodule=dm)
    last = module.history[-1]
    assert module.rounds_trained == 2
    (tested,) = trainer.test(module, datamodule=dm, verbose=False)
    assert_close_finite(tested["test/acc_mean"], last["val/acc_mean"], rtol=1e-6, atol=1e-7)
    assert_close_finite(tested["test/loss"], last["val/loss"], rtol=1e-6, atol=1e-7)
    assert module.finetuned_clients.round == 1
    assert_close_finite(tested["test/acc_ft"], module.summary["final_ft"], rtol=1e-6, atol=1e-7)


def test_test_logs_the_representation_distance() -> None:
    """Synthetic linear data with a ground-truth representation: ``test/dist_B`` is the largest principal angle's
    sine between B* and the network's representation, ‖(I − Q₁Q₁ᵀ)Q₂‖₂ with Q the orthonormal bases."""
    L.seed_everything(0, verbose=False)
    dm = SyntheticLinearDataModule(num_clients=4, dim=6, rank=2, samples_per_client=5, participation=0.5, seed=0)
    module = FederatedModule(FedAvg(1), LinearRepresentation(6, 2), aggregation="uniform")
    (tested,) = make_trainer(1).test(module, datamodule=dm, verbose=False)
    b_star = dm.federated.extras["B_star"].numpy()
    b = module.net.representation.detach().double().numpy()
    q1, q2 = np.linalg.qr(b_star)[0], np.linalg.qr(b)[0]
    expected = np.linalg.svd((np.eye(6) - q1 @ q1.T) @ q2, compute_uv=False)[0]
    assert_close_finite(tested["test/dist_B"], expected, rtol=1e-5, atol=1e-6)


def test_on_test_start_moves_the_data_to_the_modules_device() -> None:
    """``on_test_start`` puts every client split on the module's device (the ``meta`` device stands in for an
    accelerator: on the CPU the two are the same), in the network's dtype, with the shapes unchanged."""
    dm = SyntheticLinearDataModule(num_clients=4, dim=6, rank=2, samples_per_client=5, participation=0.5, seed=0)
    dm.setup("test")
    module = FederatedModule(FedAvg(1), LinearRepresentation(6, 2), aggregation="uniform")
    module.attach_data(dm.federated)
    before = dm.federated.test.x.shape
    module._device = torch.device("meta")
    module.on_test_start()
    for rows in (module.fed.train, module.fed.test):
        assert rows.x.device.type == "meta" and rows.y.device.type == "meta"
        assert rows.x.dtype == next(module.net.parameters()).dtype
    assert module.fed.test.x.shape == before


SEED, ROUND = 9, 5


COHORT = [3 * i + 2 for i in range(60)]


def _coin(tag: str, client: int) -> float:
    digest = hashlib.blake2b(repr((SEED, tag, ROUND, client)).encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") % 2**63
    return float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))


def _module(**kwargs: object) -> FederatedModule:
    module = FederatedModule(FedAvg(1, personal=("head.",)), DigitsMLP(hidden=(4,)), **kwargs)
    module.fed = SimpleNamespace(seed=SEED, num_classes=10)
    return module


# ---- simulate_faults ---------------------------------------------------------------------------------------------
def test_dropout_and_stragglers_follow_the_clients_seeded_coins() -> None:
    """p = 0.5 for both: the failed and the slow positions among ``mine`` (every other position) are those whose
    own coin is below 0.5; the two coins of a client are different draws."""
    mine = list(range(0, 60, 2))
    failed, slow = simulate_faults(_module(client_dropout=0.5, stragglers=0.5), ROUND, COHORT, mine)
    expected_failed = {j for j in mine if _coin("dropout", COHORT[j]) < 0.5}
    expected_slow = {j for j in mine if _coin("straggler", COHORT[j]) < 0.5}
    assert 0 < len(expected_failed) < len(mine) and 0 < len(expected_slow) < len(mine)
    assert expected_failed != expected_slow
    assert failed == expected_failed
    assert slow == expected_slow


def test_no_stragglers_without_a_straggler_probability() -> None:
    failed, slow = simulate_faults(_module(client_dropout=0.3), ROUND, COHORT, list(range(60)))
    assert failed == {j for j in range(60) if _coin("dropout", COHORT[j]) < 0.3}
    assert slow == set()


def test_a_coin_equal_to_the_probability_does_not_fault() -> None:
    """The probability set to a client's coin exactly: that client neither fails nor straggles (strictly below),
    while every client whose coin is lower does."""
    mine = list(range(60))
    p_drop, p_slow = _coin("dropout", COHORT[0]), _coin("straggler", COHORT[1])
    failed, slow = simulate_faults(_module(client_dropout=p_drop, stragglers=p_slow), ROUND, COHORT, mine)
    assert 0 not in failed and 1 not in slow
    assert failed == {j for j in mine if _coin("dropout", COHORT[j]) < p_drop}
    assert slow == {j for j in mine if _coin("straggler", COHORT[j]) < p_slow}


# ---- _finish_evaluation --------------------------------------------------------------------------------------------
def _scored_module() -> FederatedModule:
    module = _module()
    module.client_scores = PerClientScores(3)
    module.client_scores.update(0, 3.0, 4, 2.0)
    module.client_scores.update(2, 1.0, 2, 1.0)
    module.rounds_trained = 4
    return module


@pytest.mark.parametrize("inside_inference_mode", [False, True])
def test_finish_evaluation_is_the_last_trained_rounds_scores_as_ordinary_tensors(inside_inference_mode: bool) -> None:
    module = _scored_module()
    if inside_inference_mode:
        with torch.inference_mode():
            result = module._finish_evaluation()
    else:
        result = module._finish_evaluation()
    assert result is module.last_evaluation
    assert result.round == 3
    assert_close_finite(result.acc_per_client, torch.tensor([0.75, 0.0, 0.5], dtype=torch.float64))
    assert_close_finite(result.acc_mean, (0.75 + 0.5) / 2)
    assert not result.acc_per_client.is_inference() and not result.loss_per_client.is_inference()
    result.acc_per_client.add_(0.0)  # an inference tensor refuses in-place updates outside inference mode


# ---- end_evaluations ----------------------------------------------------------------------------------------------
def _new_clients() -> FederatedData:
    split = ClientSplit(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long), torch.tensor([0, 1, 2]))
    return FederatedData(split, split, 10)


class _Calls:
    def __init__(self) -> None:
        self.new: list[tuple[int, FederatedData]] = []
        self.clients: list[tuple[int, FineTune | None, str]] = []

    def evaluate_new_clients(self, round_idx: int, new: FederatedData) -> dict[str, Tensor]:
        self.new.append((round_idx, new))
        return {"acc_mean": torch.tensor(0.625), "loss_mean": torch.tensor(1.75)}

    def evaluate_clients(self, round_idx: int, finetune: FineTune | None = None, split: str = "test") -> dict:
        self.clients.append((round_idx, finetune, split))
        return {
            "acc_per_client": torch.tensor([0.5, 1.0]),
            "loss_per_client": torch.tensor([0.25, 0.75]),
            "acc_mean": torch.tensor(0.75),
            "acc_weighted": torch.tensor(0.8),
            "loss_mean": torch.tensor(0.5),
            "samples_per_client": torch.tensor([2.0, 3.0]),
        }


def _wired(num_classes: int | None, finetune: FineTune | None) -> tuple[FederatedModule, _Calls, FederatedData]:
    module, calls, new = _module(finetune=finetune), _Calls(), _new_clients()
    module.fed = SimpleNamespace(seed=SEED, num_classes=num_classes)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(new_clients=new))
    module.evaluate_new_clients = calls.evaluate_new_clients
    module.evaluate_clients = calls.evaluate_clients
    return module, calls, new


def testend_evaluations_reports_the_new_clients_accuracy() -> None:
    module, calls, new = _wired(10, None)
    out = module.end_evaluations(ROUND, split="test")
    assert out == {"final/new_clients_acc": 0.625}
    assert len(calls.new) == 1 and calls.new[0][0] == ROUND and calls.new[0][1] is new
    assert calls.clients == [] and module.finetuned_clients is None


def testend_evaluations_reports_the_new_clients_mse_for_regression() -> None:
    module, calls, _ = _wired(None, None)
    assert module.end_evaluations(ROUND, split="test") == {"final/new_clients_mse": 1.75}


def testend_evaluations_finetune_on_the_given_split_and_round() -> None:
    ft = FineTune(epochs=2, prefixes=("head.",))
    module, calls, _ = _wired(10, ft)
    out = module.end_evaluations(ROUND, split="val")
    assert out == {"final/new_clients_acc": 0.625, "final/acc_ft": 0.75}
    assert calls.clients == [(ROUND, ft, "val")]
    result = module.finetuned_clients
    assert result is not None and result.round == ROUND
    assert result.acc_per_client.tolist() == [0.5, 1.0]
    assert result.samples_per_client is not None and result.samples_per_client.tolist() == [2.0, 3.0]


def testend_evaluations_without_new_clients_or_finetune_is_empty() -> None:
    """No datamodule with new clients (a trainer without a datamodule attribute, or no trainer) and no "+FT"."""
    module = _module()
    assert module._trainer is None
    assert module.end_evaluations(ROUND, split="test") == {}
    module._trainer = SimpleNamespace()
    assert module.end_evaluations(ROUND, split="test") == {}
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace())
    assert module.end_evaluations(ROUND, split="test") == {}


# ---- __init__: what is stored and passed on ---------------------------------------------------------------
@pytest.mark.skipif(
    "MUTANT_UNDER_TEST" in os.environ,
    reason="mutmut runs __init__'s body under another function name, where save_hyperparameters finds no init args",
)
def test_hyperparameters_leave_out_objects_and_optimizer_factories() -> None:
    module = make_module(finetune=FineTune(epochs=2), new_client_finetune=FineTune(epochs=3))
    expected = {
        "lr",
        "momentum",
        "weight_decay",
        "batch_size",
        "decay_bias",
        "aggregation",
        "server_lr",
        "server_momentum",
        "eval_every",
        "eval_last",
        "client_dropout",
        "stragglers",
        "straggler_budget",
        "executor",
        "keep_client_optimizer_state",
        "drop_last",
        "client_state",
        "eval_clients",
        "compile",
    }
    assert set(module.hparams) == expected
    assert module.hparams["lr"] == 0.01 and module.hparams["batch_size"] == 10


def test_new_client_finetune_default_and_given() -> None:
    default = make_module().new_client_finetune
    assert isinstance(default, FineTune)
    assert (default.epochs, default.prefixes) == (10, ("head.",))  # FedRep's new clients: a head on the body
    assert FineTune().prefixes != default.prefixes  # "+FT"'s own default is the whole model (issue 40)
    given = FineTune(epochs=3, prefixes=("body.",))
    assert make_module(new_client_finetune=given).new_client_finetune is given


def test_manual_optimisation() -> None:
    assert make_module().automatic_optimization is False


def test_client_optimizer_factory_replaces_flat_settings() -> None:
    adam = functools.partial(torch.optim.Adam, lr=0.003)
    opt = make_module(client_optimizer=adam, batch_size=7, decay_bias=False).client_optimizer
    assert opt.factory is adam
    assert (opt.lr, opt.momentum, opt.batch_size, opt.decay_bias) == (0.003, 0.0, 7, False)


def test_decay_bias_false_is_kept() -> None:
    assert make_module(decay_bias=False).client_optimizer.decay_bias is False
    assert make_module().client_optimizer.decay_bias is True


def test_server_optimizer_and_both_schedules_reach_round_optimizers() -> None:
    server = functools.partial(torch.optim.Adam, lr=0.05)
    server_schedule = functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5)
    client_schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2)
    rounds = make_module(
        server_optimizer=server, server_lr_schedule=server_schedule, client_lr_schedule=client_schedule
    ).round_optimizers
    assert rounds.server_factory is server
    assert rounds.server_schedule is server_schedule
    assert rounds.client_schedule is client_schedule


def test_client_optimizer_with_default_flat_settings_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    """All three flat settings (lr, momentum, weight_decay) are compared with their defaults: at the defaults
    a client_optimizer is accepted without a warning."""
    adam = functools.partial(torch.optim.Adam, lr=0.003)
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        make_module(client_optimizer=adam, lr=0.01, momentum=0.5, weight_decay=0.0)
    assert "are ignored" not in caplog.text


@pytest.mark.parametrize("setting", [{"lr": 0.2}, {"momentum": 0.9}, {"weight_decay": 0.1}])
def test_client_optimizer_warns_about_an_ignored_flat_setting(
    setting: dict[str, float], caplog: pytest.LogCaptureFixture
) -> None:
    adam = functools.partial(torch.optim.Adam, lr=0.003)
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        make_module(client_optimizer=adam, **setting)
    assert "model.lr, model.momentum and model.weight_decay are ignored" in caplog.text


class KeepingFedAvg(FedAvg):
    keep_client_optimizer_state = True


def test_keep_client_optimizer_state_from_config_or_algorithm() -> None:
    assert make_module(keep_client_optimizer_state=True).keep_client_optimizer_state is True
    assert FederatedModule(KeepingFedAvg(1), DigitsMLP(hidden=(4,))).keep_client_optimizer_state is True
    assert make_module().keep_client_optimizer_state is False


def test_initial_run_state() -> None:
    module = make_module()
    assert module.fed is None and module.bank is None
    assert module.last_evaluation is None
    assert module.final_clients is None and module.finetuned_clients is None
    assert module.summary == {} and isinstance(module.summary, dict)
    assert module.history == []
    assert module.rounds_trained == 0
    assert module.upload_bytes == 0.0
    assert module.wall_seconds() == 0.0  # no fit started, nothing resumed


def test_checkpoint_of_a_fresh_module_has_no_bytes_and_no_time() -> None:
    checkpoint: dict[str, Any] = {}
    make_module().on_save_checkpoint(checkpoint)
    assert checkpoint["fl_upload_bytes"] == 0.0
    assert checkpoint["fl_wall_s"] == 0.0
    assert checkpoint["fl_history"] == []


def test_vectorized_fallback_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    module = FederatedModule(_Inherits(1), net, executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
        assert decide(module, 2).stacked is False
    assert caplog.text.count("falls back to 'sequential'") == 1


# ---- set-up hooks -------------------------------------------------------------------------------------------
def fake_datamodule(fed: FederatedData) -> SimpleNamespace:
    return SimpleNamespace(federated=fed)


def test_setup_without_a_datamodule_attribute_is_a_config_error() -> None:
    module = with_trainer(make_module(), precision="32-true")
    with pytest.raises(ConfigError, match="needs a FederatedDataModule"):
        module.setup("fit")


def test_setup_with_a_datamodule_that_is_not_federated_is_a_config_error() -> None:
    module = with_trainer(make_module(), datamodule=SimpleNamespace(), precision="32-true")
    with pytest.raises(ConfigError, match="needs a FederatedDataModule"):
        module.setup("fit")


@pytest.mark.parametrize("precision", ["16", 16, "16-mixed"])
def test_setup_refuses_fp16(precision: Any) -> None:
    module = with_trainer(make_module(), datamodule=fake_datamodule(digits_fed()), precision=precision)
    with pytest.raises(ConfigError, match="16-mixed is not supported"):
        module.setup("fit")


def test_setup_schedules_validation_when_fitting_only() -> None:
    fitting = with_trainer(
        make_module(eval_every=3),
        datamodule=fake_datamodule(digits_fed()),
        precision="32-true",
        val_check_interval=1.0,
        check_val_every_n_epoch=1,
    )
    fitting.setup("fit")
    assert (fitting.trainer.val_check_interval, fitting.trainer.check_val_every_n_epoch) == (3, None)
    assert fitting.fed is not None and fitting.bank is not None
    validating = with_trainer(
        make_module(eval_every=3),
        datamodule=fake_datamodule(digits_fed()),
        precision="32-true",
        val_check_interval=1.0,
        check_val_every_n_epoch=1,
    )
    validating.setup("validate")
    assert (validating.trainer.val_check_interval, validating.trainer.check_val_every_n_epoch) == (1.0, 1)
    assert validating.fed is not None


def test_schedule_validation_accepts_every_epoch_and_refuses_other_epoch_counts() -> None:
    for ok in (None, 1):
        module = with_trainer(make_module(), val_check_interval=5, check_val_every_n_epoch=ok)
        module._schedule_validation()
        assert (module.trainer.val_check_interval, module.trainer.check_val_every_n_epoch) == (5, ok)
    for bad in (2, 0):
        module = with_trainer(make_module(), val_check_interval=5, check_val_every_n_epoch=bad)
        with pytest.raises(ConfigError, match="a run is one epoch of rounds"):
            module._schedule_validation()


def test_data_dtype_follows_the_first_floating_parameter() -> None:
    module = make_module()
    assert module.data_dtype() == torch.float32
    module.net = nn.Linear(2, 2).double()
    assert module.data_dtype() == torch.float64
    module.net = nn.Module()  # no parameters at all
    assert module.data_dtype() is None


def test_on_fit_start_moves_data_to_the_module_device_and_starts_the_clock() -> None:
    module = make_module()
    module.fed = digits_fed()
    module.to(torch.device("meta"))  # stands in for an accelerator
    with_trainer(module, callbacks=[])
    before = time.perf_counter()
    module.on_fit_start()
    wall = module.wall_seconds()
    elapsed = time.perf_counter() - before
    assert module.fed.train.x.device.type == "meta" and module.fed.test.y.device.type == "meta"
    assert 0.0 < wall <= elapsed


def test_on_fit_start_refuses_a_monitored_key_never_logged() -> None:
    module = make_module()
    module.fed = digits_fed()
    with_trainer(module, callbacks=[SimpleNamespace(monitor="val/mse_mean")])
    with pytest.raises(ConfigError, match="never logged"):
        module.on_fit_start()


def test_last_rounds_force_validation_only_there() -> None:
    module = with_trainer(make_module(eval_last=2), max_steps=20, val_check_batch=5)
    batch = {"round": torch.tensor(3)}
    module.on_train_batch_start(batch, 0)
    assert module.trainer.val_check_batch == 5  # round 3 is not one of the last 2 of 20
    module.on_train_batch_start({"round": torch.tensor(18)}, 0)
    assert module.trainer.val_check_batch == 1
    timed = with_trainer(make_module(eval_last=2), max_steps=20, val_check_batch=None)
    timed.on_train_batch_start({"round": torch.tensor(19)}, 0)
    assert timed.trainer.val_check_batch is None  # a time-based interval stays


# ---- on_validation_epoch_end -------------------------------------------------------------------------------
def validating(fn: TrainerFn, sanity: bool = False, **kwargs: Any) -> tuple[FederatedModule, Recorder, Recorder]:
    """A module after round 4 whose 4 clients scored 1/2, 2/2, 0/2 and 1/2 (accuracy mean 0.5)."""
    module = make_module(**kwargs)
    module.fed = digits_fed_2()
    module.rounds_trained = 5
    module.client_scores = PerClientScores(4)
    for c, correct in enumerate([1.0, 2.0, 0.0, 1.0]):
        module.client_scores.update(c, correct, 2, 0.5 * (c + 1))
    with_trainer(module, sanity_checking=sanity, state=SimpleNamespace(fn=fn))
    log_dict, log = Recorder(), Recorder()
    module.log_dict, module.log = log_dict, log  # Lightning's own calls: none expected

    def log_scalars(metrics: dict, prog_bar: Any = False) -> None:  # the module's one logging call
        log_dict(metrics, prog_bar=prog_bar)

    module.log_scalars = log_scalars
    return module, log_dict, log


def test_validation_epoch_end_logs_the_evaluation_on_the_progress_bar_with_its_round() -> None:
    module, log_dict, log = validating(TrainerFn.FITTING, eval_last=2)
    module.history = [{"round": 2.0, "val/acc_mean": 0.25}, {"round": 3.0, "val/acc_mean": 0.75}]
    module.on_validation_epoch_end()
    assert len(log_dict.calls) == 1 and log.calls == []
    (metrics,), kwargs = log_dict.calls[0]
    assert kwargs == {"prog_bar": set(metrics) - {"round"}}  # every metric on the progress bar but its round
    assert_close_finite(metrics["val/acc_mean"], 0.5)
    assert_close_finite(metrics["val/acc_last10"], (0.75 + 0.5) / 2)  # this one and the one before
    assert_close_finite(metrics["val/loss"], np.mean([0.5 / 2, 1.0 / 2, 1.5 / 2, 2.0 / 2]))
    assert metrics["round"] == 4.0 and list(metrics)[-1] == "round"
    assert module.history[-1]["round"] == 4 and len(module.history) == 3


def test_validation_epoch_end_outside_fit_has_no_last10_and_keeps_history() -> None:
    module, log_dict, log = validating(TrainerFn.VALIDATING)
    module.on_validation_epoch_end()
    ((metrics,), kwargs), = log_dict.calls
    assert kwargs == {"prog_bar": set(metrics) - {"round"}} and "val/acc_mean" in kwargs["prog_bar"]
    assert "val/acc_last10" not in metrics
    assert module.history == []
    assert metrics["round"] == 4.0 and log.calls == []


def test_validation_epoch_end_during_the_sanity_check_logs_nothing() -> None:
    module, log_dict, log = validating(TrainerFn.FITTING, sanity=True)
    module.on_validation_epoch_end()
    assert log_dict.calls == [] and log.calls == [] and module.history == []


# ---- validation_step, on_validation_start ------------------------------------------------------------------
@pytest.mark.parametrize("val", [False, True])
def test_validation_step_evaluates_the_last_trained_round_on_the_validation_split(
    monkeypatch: pytest.MonkeyPatch, val: bool
) -> None:
    module = make_module()
    module.fed = digits_fed_2(val=val)
    module.rounds_trained = 7
    module.client_scores = PerClientScores(4)
    with_trainer(module, sanity_checking=False)
    recorder = Recorder()
    monkeypatch.setattr(evaluation, "evaluate_clients", recorder)
    module.validation_step([1, 3], 0)
    assert recorder.calls == [((module, [1, 3], 6, module.client_scores), {"split": "val" if val else "test"})]


def test_validation_step_skips_the_sanity_check(monkeypatch: pytest.MonkeyPatch) -> None:
    module = make_module()
    module.fed = digits_fed_2()
    with_trainer(module, sanity_checking=True)
    recorder = Recorder()
    monkeypatch.setattr(evaluation, "evaluate_clients", recorder)
    module.validation_step([0, 1], 0)
    assert recorder.calls == []


def test_validation_step_scores_each_client_on_its_val_rows() -> None:
    """The real evaluation: clients 0 and 2 are scored on their one validation row, not their two test rows."""
    module = make_module()
    module.attach_data(digits_fed_2(val=True))
    module.rounds_trained = 3
    with_trainer(module, sanity_checking=False)
    module.validation_step([0, 2], 0)
    assert module.client_scores.total.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_validation_start_moves_the_data_to_the_module_device_and_dtype() -> None:
    module = FederatedModule(FedAvg(1), nn.Linear(64, 10).double())
    module.fed = digits_fed_2(val=True)
    module.to(torch.device("meta"))  # stands in for an accelerator
    module.on_validation_start()
    for part in (module.fed.train, module.fed.test, module.fed.val):
        assert part.x.device.type == "meta" and part.x.dtype == torch.float64
        assert part.y.dtype == torch.int64  # labels keep their integer type


# ---- _log_round, _count_upload -----------------------------------------------------------------------------
def logging_round(**kwargs: Any) -> tuple[FederatedModule, Recorder]:
    module = make_module(**kwargs)
    module.ledger = SimpleNamespace(download_bytes=4096)
    module.upload_bytes = 100.0
    log_dict = Recorder()
    module.log_scalars = log_dict
    return module, log_dict


def round_stats() -> RoundStats:
    return RoundStats(
        weight=4.0, weighted_loss=2.0, samples=9.0, survivors=3.0, dropped=1.0, non_finite=0.0, stragglers=2.0,
        upload_bytes=640.0,
    )  # fmt: skip


def test_log_round_logs_loss_clients_bytes_and_round() -> None:
    module, log_dict = logging_round()
    module._log_round(7, round_stats())
    assert len(log_dict.calls) == 1  # no faults configured, none non-finite: no faults/ keys
    (metrics,), kwargs = log_dict.calls[0]
    assert metrics == {
        "train/loss": 0.5,  # 2.0 / 4.0
        "train/clients": 3.0,
        "comm/upload_bytes": 640.0,
        "comm/upload_bytes_total": 740.0,
        "comm/download_bytes": 4096.0,
        "round": 7.0,
    }
    assert not kwargs.get("prog_bar")
    assert module.upload_bytes == 740.0


@pytest.mark.parametrize("setting", [{"client_dropout": 0.5}, {"stragglers": 0.25}, {}])
def test_log_round_logs_faults_when_simulated_or_non_finite(setting: dict[str, float]) -> None:
    module, log_dict = logging_round(**setting)
    stats = round_stats()
    if not setting:
        stats.non_finite = 1.0
    module._log_round(2, stats)
    assert len(log_dict.calls) == 1  # one call per round, faults included
    (metrics,), _ = log_dict.calls[0]
    faults = {"faults/dropped": 1.0, "faults/non_finite": stats.non_finite, "faults/stragglers": 2.0}
    assert {k: v for k, v in metrics.items() if k.startswith("faults/")} == faults
    assert metrics["round"] == 2.0 and metrics["train/loss"] == 0.5


def test_count_upload_accumulates() -> None:
    module = make_module()
    assert module._count_upload(640) == 640.0
    assert module._count_upload(360.0) == 1000.0
    assert module.upload_bytes == 1000.0


# ---- wall_seconds ------------------------------------------------------------------------------------------
def test_wall_seconds_adds_this_process_to_the_resumed_time() -> None:
    module = make_module()
    module.resumed_wall_s = 5.0
    start = time.perf_counter()
    module._fit_start = start - 2.0  # this process started its clock 2 s ago
    wall = module.wall_seconds()
    elapsed = time.perf_counter() - start
    assert 7.0 - 1e-9 <= wall <= 7.0 + elapsed + 1e-9


def test_wall_seconds_before_the_clock_starts_is_the_resumed_time() -> None:
    module = make_module()
    module.resumed_wall_s = 5.0
    assert module.wall_seconds() == 5.0


# ---- validates_after ---------------------------------------------------------------------------------------
def validating_2(every: float | None, enabled: bool = True, eval_last: int = 0, max_steps: int = 10) -> FederatedModule:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), eval_last=eval_last)
    with_trainer(
        module,
        enable_validation=enabled,
        max_steps=max_steps,
        val_check_batch=every,
        state=SimpleNamespace(fn=TrainerFn.FITTING),
    )
    return module


def test_validates_after_every_interval() -> None:
    module = validating_2(3)
    assert [r for r in range(10) if module.validates_after(r)] == [2, 5, 8]


def test_validates_after_the_last_rounds_whatever_the_interval() -> None:
    module = validating_2(4, eval_last=3)
    assert [r for r in range(10) if module.validates_after(r)] == [3, 7, 8, 9]
    assert [r for r in range(10) if validating_2(None, eval_last=2).validates_after(r)] == [8, 9]


def test_validates_after_an_infinite_interval_only_the_last_round() -> None:
    module = validating_2(float("inf"))
    assert [r for r in range(10) if module.validates_after(r)] == [9]


def test_validates_after_a_time_based_interval_is_unknown() -> None:
    module = validating_2(None)
    assert not any(module.validates_after(r) for r in range(10))


def test_no_validation_when_disabled() -> None:
    module = validating_2(1, enabled=False, eval_last=5)
    assert not any(module.validates_after(r) for r in range(10))
    assert validating_2(1).validates_after(0)


# ---- on_save_checkpoint ------------------------------------------------------------------------------------
def saving(rounds: int, history_rounds: list[int], every: int = 2, fn: TrainerFn = TrainerFn.FITTING) -> dict:
    module = validating_2(every)
    module.trainer.state.fn = fn
    module.rounds_trained = rounds
    module.history = [{"round": float(r), "val/acc_mean": 0.5} for r in history_rounds]
    module.upload_bytes = 321.0
    module.resumed_wall_s = 2.5
    checkpoint: dict[str, Any] = {}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint["fl_history"] == module.history and checkpoint["fl_history"] is not module.history
    return checkpoint


def test_save_checkpoint_writes_history_bytes_time_and_identity() -> None:
    checkpoint = saving(4, [1, 3])
    assert checkpoint["fl_upload_bytes"] == 321.0
    assert checkpoint["fl_wall_s"] == 2.5
    assert checkpoint["fl_identity"] == {"algorithm": FEDAVG, "network": DIGITS}
    assert len(checkpoint["fl_history"]) == 2


def test_save_checkpoint_marks_a_round_saved_before_its_validation() -> None:
    assert saving(4, [1])["fl_skips_validation_of"] == 3  # round 3 validates, last evaluated round 1
    assert saving(2, [])["fl_skips_validation_of"] == 1  # nothing evaluated yet
    assert saving(1, [], every=1)["fl_skips_validation_of"] == 0  # round 0 counts too


def test_save_checkpoint_after_the_validation_or_between_validations_skips_nothing() -> None:
    assert saving(4, [1, 2, 3])["fl_skips_validation_of"] is None  # round 3 (the last entry) is evaluated already
    assert saving(4, [1, 3])["fl_skips_validation_of"] is None
    assert saving(3, [])["fl_skips_validation_of"] is None  # round 2 does not validate (every 2)


def test_save_checkpoint_outside_fit_or_before_any_round_has_no_mark() -> None:
    assert "fl_skips_validation_of" not in saving(4, [1], fn=TrainerFn.VALIDATING)
    assert "fl_skips_validation_of" not in saving(0, [], every=1)


# ---- on_load_checkpoint ------------------------------------------------------------------------------------
def test_load_checkpoint_restores_the_run_state(caplog: pytest.LogCaptureFixture) -> None:
    module = fedrep(4)
    module.trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING))
    history = [{"round": 1.0, "val/acc_mean": 0.25}]
    checkpoint = {
        "state_dict": module.state_dict(), "fl_identity": identity(module), "fl_history": history,
        "global_step": 7, "fl_upload_bytes": 99.0, "fl_wall_s": 12.5, "fl_skips_validation_of": None,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        module.on_load_checkpoint(checkpoint)
    assert caplog.records == []
    assert module.history == history and module.history is not history
    assert module.rounds_trained == 7 and isinstance(module.rounds_trained, int)
    assert module.upload_bytes == 99.0 and module.resumed_wall_s == 12.5


def test_load_checkpoint_defaults_for_an_old_checkpoint() -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))  # no bank yet: nothing to compare
    with_trainer(module, state=SimpleNamespace(fn=TrainerFn.FITTING))
    module.history, module.rounds_trained, module.upload_bytes, module.resumed_wall_s = [{"round": 0.0}], 3, 5.0, 6.0
    module.on_load_checkpoint({"fl_identity": {"algorithm": "x.Other", "network": "y.Net"}})
    assert module.history == [] and module.rounds_trained == 0
    assert module.upload_bytes == 0.0 and module.resumed_wall_s == 0.0


def test_load_checkpoint_refuses_another_model() -> None:
    module = fedrep(4)
    with_trainer(module, state=SimpleNamespace(fn=TrainerFn.FITTING))
    with pytest.raises(ConfigError) as error:
        module.on_load_checkpoint({"state_dict": fedrep(5).state_dict(), "global_step": 3})
    assert str(error.value) == "the checkpoint has 5 clients, this config 4"
    assert module.rounds_trained == 0


@pytest.mark.parametrize(("skipped", "fn", "warned"), [(3, TrainerFn.FITTING, True), (3, TrainerFn.TESTING, False),
                                                       (None, TrainerFn.FITTING, False)])  # fmt: skip
def test_load_checkpoint_warns_about_a_skipped_validation_when_fitting(
    caplog: pytest.LogCaptureFixture, skipped: int | None, fn: TrainerFn, warned: bool
) -> None:
    module = fedrep(4)
    with_trainer(module, state=SimpleNamespace(fn=fn))
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        module.on_load_checkpoint({"state_dict": module.state_dict(), "fl_skips_validation_of": skipped})
    assert len(caplog.records) == int(warned)
    if warned:
        assert "before the validation of round 3" in caplog.records[0].getMessage()


SIZES = (3, 4, 5, 2)


KEPT = "client_optimizer."


class _Recorder(Algorithm):
    """Personal head; a client uploads ``global + client/100``, its new state is twice the old one, its kept
    optimiser state comes back one higher; loss = client id. Every context is recorded. An engine test double, not
    an algorithm: it reads each context's own attributes (``clients``, ``client``) to see what the executor handed
    it, so its context is not named ``ctx`` (``fl_lightning.engine.contract`` checks algorithms' ``ctx``)."""

    personal = ("head.",)
    vectorizable = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def client_update(self, context: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        kept = context.optimizer_state
        vector = hasattr(context, "clients")
        self.calls.append(
            {
                "vector": vector,
                "clients": list(context.clients) if vector else [context.client],
                "round": context.round,
                "budgets": list(context.step_budgets) if vector else [context.step_budget],
                "kept": None if kept is None else {n: v.clone() for n, v in kept.items()},
                "state": {n: v.clone() for n, v in state.items()},
                "global": {n: v.clone() for n, v in global_params.items()},
            }
        )
        if kept is not None:
            context.optimizer_state = {n: v + 1 for n, v in kept.items()}
        c = torch.tensor(context.clients if vector else context.client, dtype=torch.float32)
        shift = c.view(-1, *[1] * (next(iter(global_params.values())).dim() - 1)) if vector else c
        upload = {n: global_params[n] + shift / 100 for n in self.shared_names(global_params)}
        new_state = {n: 2 * v for n, v in state.items()}
        return ClientUpdate(upload, new_state, context.num_samples, c.double())


def _fed() -> FederatedData:
    g = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    ptr = torch.tensor([0, 3, 7, 12, 14], dtype=torch.long)
    split = ClientSplit(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), ptr)
    return FederatedData(split, split, 10, 5)


def _module_2(keep: bool, executor: str) -> FederatedModule:
    module = FederatedModule(
        _Recorder(), DigitsMLP(hidden=(3,)), momentum=0.5, keep_client_optimizer_state=keep, executor=executor
    )
    module.attach_data(_fed())
    g = torch.Generator().manual_seed(9)
    for name in module.bank.names:  # distinct rows per client, so a mixed-up row shows
        row = module.bank.row(name)
        if row.is_floating_point():
            row.copy_(torch.randn(row.shape, generator=g))
        else:
            row.copy_(torch.arange(row.shape[0]) + 3)
    return module


def _glob(module: FederatedModule) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


def _bank_row(module: FederatedModule, c: int) -> dict[str, Tensor]:
    return {n: module.bank.row(n)[c].clone() for n in module.bank.names}


# ---- run_clients ---------------------------------------------------------------------------------------------
class _Axis:
    def __init__(self) -> None:
        self.args: tuple | None = None
        self.result = [object()]

    def run_clients(self, *args: Any) -> list:
        self.args = args
        return self.result


def test_a_batched_run_hands_the_round_to_its_run_axis() -> None:
    module = _module_2(False, "sequential")
    axis = _Axis()
    module.run_axis = axis
    glob, states, budgets = _glob(module), [_bank_row(module, 1), _bank_row(module, 3)], [1.0, 0.5]
    clients = [1, 3]
    assert module.run_clients(clients, 4, glob, states, budgets) is axis.result
    assert axis.args is not None and len(axis.args) == 7
    assert axis.args[0] is module and axis.args[1] is clients and axis.args[2] == 4
    assert axis.args[3] is glob and axis.args[4] is states and axis.args[5] is budgets
    assert axis.args[6].path == "sequential"  # the path the run takes alone, decided before it hands them in
    assert module.algorithm.calls == []


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_kept_optimizer_state_goes_in_through_the_context_and_comes_back_in_the_state(executor: str) -> None:
    """With ``keep_client_optimizer_state``: the algorithm sees its own state only, the context the kept rows;
    each client's new state is the algorithm's (2·old) plus the kept rows the context ends with (old + 1)."""
    module = _module_2(True, executor)
    assert decide(module, len([2, 0, 3])).stacked is (executor == "vectorized")
    clients, budgets = [2, 0, 3], [1.0, 0.25, 0.5]
    glob = _glob(module)
    before = [_bank_row(module, c) for c in clients]
    assert any(n.startswith(KEPT) for n in before[0]) and "head.weight" in before[0]
    updates = module.run_clients(clients, 6, glob, before, budgets)

    calls = module.algorithm.calls
    assert len(calls) == (1 if executor == "vectorized" else 3)
    assert [c for call in calls for c in call["clients"]] == clients
    assert [b for call in calls for b in call["budgets"]] == budgets
    assert all(call["round"] == 6 for call in calls)
    for k, c in enumerate(clients):
        call, i = (calls[0], k) if executor == "vectorized" else (calls[k], None)

        def row(t: Tensor, i: int | None = i) -> Tensor:
            return t if i is None else t[i]

        assert set(call["state"]) == {"head.weight", "head.bias"}
        assert set(call["kept"]) == {n for n in before[k] if n.startswith(KEPT)}
        for n, v in call["state"].items():
            assert_close_finite(row(v), before[k][n])
        for n, v in call["kept"].items():
            assert torch.equal(row(v), before[k][n]), n
        for n, v in call["global"].items():
            assert_close_finite(row(v), glob[n])

        upd = updates[k]
        assert set(upd.state) == set(before[k])
        for n, v in upd.state.items():
            expected = before[k][n] + 1 if n.startswith(KEPT) else 2 * before[k][n]
            assert v.shape == before[k][n].shape, n
            assert torch.equal(v, expected) if not v.is_floating_point() else bool(torch.allclose(v, expected)), n
        assert set(upd.upload) == {n for n in glob if not n.startswith("head.")}
        for n, v in upd.upload.items():
            assert_close_finite(v, glob[n] + c / 100, rtol=1e-6, atol=1e-6)
        assert upd.num_samples == SIZES[c]
        assert_close_finite(upd.loss, float(c))


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_without_kept_state_the_context_starts_a_fresh_optimizer(executor: str) -> None:
    """Without ``keep_client_optimizer_state`` every context has no optimiser state (``None``: fresh) and the new
    state is the algorithm's only."""
    module = _module_2(False, executor)
    clients = [1, 3]
    before = [_bank_row(module, c) for c in clients]
    assert set(before[0]) == {"head.weight", "head.bias"}
    updates = module.run_clients(clients, 2, _glob(module), before, [1.0, 1.0])
    assert module.algorithm.calls and all(call["kept"] is None for call in module.algorithm.calls)
    for k in range(2):
        assert set(updates[k].state) == {"head.weight", "head.bias"}
        for n, v in updates[k].state.items():
            assert_close_finite(v, 2 * before[k][n])


def test_vectorized_single_client() -> None:
    module = _module_2(False, "vectorized")
    before = [_bank_row(module, 2)]
    (upd,) = module.run_clients([2], 0, _glob(module), before, [1.0])
    assert module.algorithm.calls[0]["vector"] is True
    assert upd.num_samples == SIZES[2]
    for n, v in upd.state.items():
        assert_close_finite(v, 2 * before[0][n])


def test_no_clients_run_nothing() -> None:
    module = _module_2(False, "sequential")
    assert module.run_clients([], 0, _glob(module), [], []) == []
    assert module.algorithm.calls == []


# ---- training_step -------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def test_the_cohorts_bank_rows_are_gathered_with_ids_on_the_modules_device() -> None:
    """The round's client ids index the bank on the module's device (``meta`` stands in for an accelerator)."""
    module = _module_2(False, "sequential")
    module._device = torch.device("meta")
    seen: list[Tensor] = []

    def gather(clients: Tensor) -> dict[str, Tensor]:
        seen.append(clients)
        raise _Stop

    module.bank.gather = gather
    with pytest.raises(_Stop):
        module.training_step({"round": torch.tensor(0), "clients": torch.tensor([2, 0])}, 0)
    assert len(seen) == 1 and seen[0].device.type == "meta"


def _coin_2(seed: int, tag: str, round_idx: int, client: int) -> float:
    """The seeded coin of (seed, tag, round, client): blake2b of the parts' repr, 63 bits, one ``torch.rand``."""
    digest = hashlib.blake2b(repr((seed, tag, round_idx, client)).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return float(torch.rand(1, generator=g))


class _RoundRecorder(Algorithm):
    """Shared-only method: a client uploads the global model plus a small client-dependent shift (it reads
    ``ctx.client``, which only the sequential loop offers)."""

    vectorizable = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, float]] = []

    def client_update(self, ctx: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        self.calls.append((ctx.round, ctx.client, ctx.step_budget))
        upload = {n: v + 0.001 * (ctx.client + 1) for n, v in global_params.items()}
        return ClientUpdate(upload, dict(state), ctx.num_samples, 0.5)


DROPOUT, STRAGGLERS, BUDGET, CLIENTS, ROUNDS = 0.3, 0.5, 0.25, 8, 2


@pytest.fixture(scope="module")
def faulty_fit() -> dict[str, Any]:
    """Two rounds, all 8 clients every round, with dropout and stragglers; the logs and the reduction's layouts."""
    torch.manual_seed(0)
    dm = SyntheticLinearDataModule(num_clients=CLIENTS, dim=4, rank=2, samples_per_client=3, participation=1.0, seed=2)
    module = FederatedModule(
        _RoundRecorder(),
        LinearRepresentation(4, 2),
        aggregation="uniform",
        client_dropout=DROPOUT,
        stragglers=STRAGGLERS,
        straggler_budget=BUDGET,
        eval_every=100,
        executor="sequential",  # the recorder reads ctx.client: the reference loop's context
    )
    logged: list[dict[str, Any]] = []
    original_log_scalars = module.log_scalars
    module.log_scalars = lambda metrics, **kw: (logged.append(dict(metrics)), original_log_scalars(metrics, **kw))
    layouts: list[Any] = []
    original_all_reduce = aggregation.CohortSums.all_reduce

    def all_reduce(self: Any, strategy: Any, device: torch.device, layout: Any = None) -> Any:
        layouts.append(layout)
        return original_all_reduce(self, strategy, device, layout)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aggregation.CohortSums, "all_reduce", all_reduce)
        make_trainer(ROUNDS, logger=False).fit(module, datamodule=dm)
    seed = module.fed.seed
    failed = {(r, c) for r in range(ROUNDS) for c in range(CLIENTS) if _coin_2(seed, "dropout", r, c) < DROPOUT}
    slow = {(r, c) for r in range(ROUNDS) for c in range(CLIENTS) if _coin_2(seed, "straggler", r, c) < STRAGGLERS}
    return {"module": module, "logged": logged, "layouts": layouts, "failed": failed, "slow": slow}


def test_faults_follow_each_rounds_coins_and_stragglers_get_the_budget(faulty_fit: dict[str, Any]) -> None:
    failed, slow = faulty_fit["failed"], faulty_fit["slow"]
    assert failed and slow - failed and set(range(CLIENTS)) - {c for r, c in failed | slow if r == 0}
    expected = [
        (r, c, BUDGET if (r, c) in slow else 1.0) for r in range(ROUNDS) for c in range(CLIENTS) if (r, c) not in failed
    ]
    assert sorted(faulty_fit["module"].algorithm.calls) == expected


def test_fault_counts_are_logged_each_round(faulty_fit: dict[str, Any]) -> None:
    failed, slow = faulty_fit["failed"], faulty_fit["slow"]
    faults = [m for m in faulty_fit["logged"] if "faults/stragglers" in m]
    assert len(faults) == ROUNDS
    for r, m in enumerate(faults):
        assert float(m["faults/dropped"]) == sum(1 for c in range(CLIENTS) if (r, c) in failed)
        assert float(m["faults/stragglers"]) == sum(1 for c in range(CLIENTS) if (r, c) in slow - failed)


def test_the_ledger_records_each_round_under_its_index(faulty_fit: dict[str, Any]) -> None:
    assert [h.round for h in faulty_fit["module"].ledger.history] == list(range(ROUNDS))


def test_the_reduction_gets_every_ranks_reporting_positions(faulty_fit: dict[str, Any]) -> None:
    """One process: one rank holding the whole cohort; its reporting positions are the clients that did not fail
    (the cohort is every client in order, so position = client id)."""
    failed = faulty_fit["failed"]
    expected = [[[c for c in range(CLIENTS) if (r, c) not in failed]] for r in range(ROUNDS)]
    assert faulty_fit["layouts"] == expected


class _BadUpload(_RoundRecorder):
    def client_update(self, ctx: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        return ClientUpdate({}, dict(state), ctx.num_samples, 0.5)


def test_an_upload_that_is_not_the_template_names_the_method() -> None:
    dm = SyntheticLinearDataModule(num_clients=3, dim=4, rank=2, samples_per_client=3, participation=1.0, seed=2)
    module = FederatedModule(_BadUpload(), LinearRepresentation(4, 2), aggregation="uniform", eval_every=100)
    with pytest.raises(RuntimeError, match=r"^_BadUpload uploaded \[\], not its template"):
        make_trainer(1, logger=False).fit(module, datamodule=dm)


TRAIN_SIZES = (3, 4, 5, 2)


TEST_SIZES = (2, 1, 3, 2)


def _split(sizes: tuple[int, ...], seed: int) -> ClientSplit:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    ptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.long)
    return ClientSplit(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), ptr)


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    return x + torch.randn(x.shape, generator=g)


def _fed_2(
    clients: int = 4, side: bool = False, seed: int = 7, extras: dict[str, Tensor] | None = None
) -> FederatedData:
    train, test = _split(TRAIN_SIZES[:clients], 1), _split(TEST_SIZES[:clients], 2)
    side_t = torch.arange(clients * 3, dtype=torch.float32).reshape(clients, 3) if side else None
    return FederatedData(train, test, 10, seed, side_t, _augment, extras or {})


def _rows(sizes: tuple[int, ...], c: int) -> tuple[int, int]:
    lo = sum(sizes[:c])
    return lo, lo + sizes[c]


# ---- attach_data ---------------------------------------------------------------------------------------------
def test_reattaching_the_same_federation_keeps_the_bank_and_a_new_size_rebuilds_it() -> None:
    """Attach is idempotent: a second attach with the same number of clients keeps the bank (and a row written into
    it); a federation of another size gets a fresh bank of that size."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed_2(4))
    bank = module.bank
    assert bank.num_clients == 4
    bank.row("head.bias")[2] += 5.0
    written = bank.row("head.bias")[2].clone()
    module.attach_data(_fed_2(4))
    assert module.bank is bank
    assert_close_finite(module.bank.row("head.bias")[2], written)
    module.attach_data(_fed_2(3))
    assert module.bank is not bank and module.bank.num_clients == 3
    assert module.bank.row("head.bias").shape[0] == 3


def _sgd_tensor_state_keys(momentum: float) -> set[str]:
    """The per-parameter tensor state keys of ``torch.optim.SGD`` after one step (the reference)."""
    p = torch.zeros(2, 3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=momentum)
    p.grad = torch.ones_like(p)
    opt.step()
    return {k for k, v in opt.state[p].items() if isinstance(v, Tensor)}


def test_kept_client_optimizer_state_adds_zero_rows_for_every_trainable_parameter() -> None:
    """``keep_client_optimizer_state``: the bank holds, next to the personal head, a step counter and every SGD
    momentum buffer (shaped like its parameter, zero) for each trainable parameter, none for a frozen one."""
    net = DigitsMLP(hidden=(4,))
    frozen = [n for n, _ in net.named_parameters() if n.startswith("body.")][-1]
    net.get_parameter(frozen).requires_grad_(False)
    module = FederatedModule(FedAvg(1, personal=["head."]), net, momentum=0.5, keep_client_optimizer_state=True)
    module.attach_data(_fed_2(4))
    trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
    keys = _sgd_tensor_state_keys(0.5)
    assert keys == {"momentum_buffer"}
    expected = {"head.weight", "head.bias"}
    expected |= {f"client_optimizer.steps.{n}" for n in trainable}
    expected |= {f"client_optimizer.{k}.{n}" for n in trainable for k in keys}
    assert set(module.bank.names) == expected
    assert frozen not in trainable
    for n, p in trainable.items():
        buf = module.bank.row(f"client_optimizer.momentum_buffer.{n}")
        assert buf.shape == (4, *p.shape)
        assert not buf.any()
        assert module.bank.row(f"client_optimizer.steps.{n}").shape == (4,)


def test_bank_and_client_scores_go_to_the_modules_device() -> None:
    """The bank and the per-client scores are built on the module's device (``meta`` stands in for a GPU)."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module._device = torch.device("meta")
    module.attach_data(_fed_2(4))
    buffers = list(module.bank.buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers)
    for name in ("correct", "total", "loss_sum"):
        assert getattr(module.client_scores, name).device.type == "meta"


def test_ddp_ignores_exactly_the_banks_buffers() -> None:
    """DDP is told to skip every buffer of the client-state bank (named as the module names them), nothing else."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed_2(4))
    expected = [n for n, _ in module.named_buffers() if n.startswith("bank.")]
    assert len(expected) == 2
    assert module._ddp_params_and_buffers_to_ignore == expected


class _GroundTruthRecorder(FedAvg):
    """FedAvg that keeps what ``bind_ground_truth`` received."""

    def bind_ground_truth(self, extras: dict[str, Tensor]) -> None:
        self.bound = extras


def test_the_algorithm_receives_the_datas_ground_truth() -> None:
    extras = {"B_star": torch.eye(3)}
    algorithm = _GroundTruthRecorder(1)
    module = FederatedModule(algorithm, DigitsMLP(hidden=(4,)))
    module.attach_data(_fed_2(4, extras=extras))
    assert algorithm.bound is extras


class _Plain(nn.Module):
    """A network without any ``side`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.lin(x)


def _concat_net() -> SplitModel:
    return SplitModel(nn.Linear(64, 4), nn.Linear(6, 10), Concat(nn.Linear(3, 2)))


def test_ledger_side_information_follows_the_side_branch() -> None:
    """Side data and a ``Concat`` branch: the ledger states what ``Concat`` reveals and treats every upload as
    side-dependent; side data and a network without a declaring branch: "side information"; no side data: none."""
    module = FederatedModule(FedAvg(1), _concat_net())
    module.attach_data(_fed_2(4, side=True))
    assert module.ledger.side_reveals == Concat.reveals
    assert module.ledger.side_dependent == ("",)
    assert module.ledger.describe().endswith("; " + Concat.reveals)

    for net in (_Plain(), DigitsMLP(hidden=(4,))):
        module = FederatedModule(FedAvg(1), net)
        module.attach_data(_fed_2(4, side=True))
        assert module.ledger.side_reveals == "side information"
        assert module.ledger.side_dependent == ("",)

    module = FederatedModule(FedAvg(1), _concat_net())
    module.attach_data(_fed_2(4, side=False))
    assert module.ledger.side_reveals is None
    assert module.ledger.side_dependent == ()


# ---- client_context ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attached_2() -> tuple[FederatedModule, FederatedData]:
    fed = _fed_2(4, side=True, seed=7)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    module.attach_data(fed)
    return module, fed


def test_training_context_reads_the_clients_training_rows(attached_2: tuple[FederatedModule, FederatedData]) -> None:
    """Defaults: the training split, the augmentation, a full step budget, the run's seed, the client's side."""
    module, fed = attached_2
    ctx = client_context(module, 2, 3)
    lo, hi = _rows(TRAIN_SIZES, 2)
    assert_close_finite(ctx.x, fed.train.x[lo:hi])
    assert torch.equal(ctx.y, fed.train.y[lo:hi])
    assert_close_finite(ctx.side, torch.tensor([6.0, 7.0, 8.0]))
    assert ctx.augment is _augment
    assert (ctx.client, ctx.round, ctx.seed, ctx.step_budget) == (2, 3, 7, 1.0)


def test_test_context_reads_the_test_rows_without_augmentation(
    attached_2: tuple[FederatedModule, FederatedData],
) -> None:
    module, fed = attached_2
    ctx = client_context(module, 1, 0, split="test", tag="eval", step_budget=0.25)
    lo, hi = _rows(TEST_SIZES, 1)
    assert ctx.x.shape[0] == TEST_SIZES[1]
    assert_close_finite(ctx.x, fed.test.x[lo:hi])
    assert torch.equal(ctx.y, fed.test.y[lo:hi])
    assert ctx.augment is None
    assert_close_finite(ctx.side, torch.tensor([3.0, 4.0, 5.0]))
    assert (ctx.seed, ctx.step_budget) == (7, 0.25)


def test_context_without_side_data_has_no_side() -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed_2(4, side=False))
    assert client_context(module, 0, 0).side is None


# ---- vectorized ----------------------------------------------------------------------------------------------
def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fl_lightning" and r.levelno == logging.WARNING]


def test_vectorized_applies_to_a_vectorizable_method_without_batchnorm(caplog: pytest.LogCaptureFixture) -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is True
        assert decide(module, 2).stacked is True
    assert _warnings(caplog) == []


def test_sequential_executor_is_never_vectorized(caplog: pytest.LogCaptureFixture) -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), executor="sequential")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
    assert _warnings(caplog) == []


class _Inherits(FedAvg):
    """A subclass of a vectorizable method that does not declare ``vectorizable`` itself."""


def test_a_subclass_must_declare_vectorizable_itself_and_the_fallback_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = FederatedModule(_Inherits(1), DigitsMLP(hidden=(4,)), executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
        assert decide(module, 2).stacked is False
    assert _warnings(caplog) == [
        "executor 'vectorized' falls back to 'sequential': _Inherits is not marked vectorizable"
    ]


def test_a_batchnorm_network_trains_stacked_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Per-client BatchNorm statistics are stacked (``client.FunctionalBatchNorm``): no fallback in training."""
    net = nn.Sequential(nn.Linear(64, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))
    module = FederatedModule(FedAvg(1), net, executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is True
    assert _warnings(caplog) == []


def test_validation_start_moves_data_once_and_again_when_the_data_or_the_dtype_change() -> None:
    module = FederatedModule(FedAvg(1), nn.Linear(64, 10))
    module.fed = digits_fed_2(val=True)
    module.on_validation_start()
    moved = module.fed
    module.on_validation_start()  # already there: the same data, not an equal copy
    assert module.fed is moved and moved.train.x.dtype == torch.float32
    module.net.double()  # the network's dtype changed: the data follows
    module.on_validation_start()
    assert module.fed is not moved and module.fed.train.x.dtype == torch.float64
    fresh = digits_fed_2(val=True)
    module.fed = fresh  # new data (attach_data): moved
    module.on_validation_start()
    assert module.fed is not fresh and module.fed.train.x.dtype == torch.float64
