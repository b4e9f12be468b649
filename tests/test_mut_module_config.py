"""FederatedModule's configuration: the argument checks of ``__init__`` (each boundary accepted and refused),
what it stores and hands on (client/server optimisers, schedules, hyperparameters, initial run state), and the
set-up hooks (``setup``, ``_schedule_validation``, ``on_fit_start``, ``data_dtype``, ``on_train_batch_start``,
``validation_metric_names``, ``_check_monitored_keys``), driven directly with a stand-in trainer."""

from __future__ import annotations

import functools
import logging
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ranged_client_split as split
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.linear import LinearRepresentation


def make_module(**kwargs: Any) -> FederatedModule:
    return FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **kwargs)


def digits_fed(extras: dict[str, torch.Tensor] | None = None) -> FederatedData:
    return FederatedData(split([3, 2], 64, True), split([2, 2], 64, True), 10, extras=extras or {})


def regression_fed(extras: dict[str, torch.Tensor] | None = None) -> FederatedData:
    return FederatedData(split([3, 2], 4, False), split([2, 2], 4, False), None, extras=extras or {})


# ---- __init__: argument checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["client_dropout", "stragglers"])
def test_probabilities_accept_0_and_1_and_refuse_above_1(name: str) -> None:
    assert getattr(make_module(**{name: 1.0}), name) == 1.0
    assert getattr(make_module(**{name: 0.0}), name) == 0.0
    with pytest.raises(ConfigError, match=f"model.{name} is a probability"):
        make_module(**{name: 1.5})
    with pytest.raises(ConfigError, match=f"model.{name} is a probability"):
        make_module(**{name: -0.1})


def test_straggler_budget_is_a_fraction_in_0_excluded_to_1() -> None:
    assert make_module(straggler_budget=1.0).straggler_budget == 1.0
    assert make_module(straggler_budget=0.25).straggler_budget == 0.25
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ConfigError, match="straggler_budget"):
            make_module(straggler_budget=bad)


@pytest.mark.parametrize("name", ["eval_last", "momentum", "weight_decay"])
def test_each_non_negative_setting_alone_is_refused_below_0(name: str) -> None:
    with pytest.raises(ConfigError, match="must be ≥ 0"):
        make_module(**{name: -1})


def test_eval_last_0_momentum_0_and_weight_decay_0_are_accepted() -> None:
    module = make_module(eval_last=0, momentum=0.0, weight_decay=0.0)
    assert module.eval_last == 0
    assert (module.client_optimizer.momentum, module.client_optimizer.weight_decay) == (0.0, 0.0)


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
    }
    assert set(module.hparams) == expected
    assert module.hparams["lr"] == 0.01 and module.hparams["batch_size"] == 10


def test_new_client_finetune_default_and_given() -> None:
    default = make_module().new_client_finetune
    assert isinstance(default, FineTune)
    assert (default.epochs, default.prefixes) == (10, ("head.",))
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
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    module = FederatedModule(FedAvg(1), net, executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert module.vectorized() is False
        assert module.vectorized() is False
    assert caplog.text.count("falls back to 'sequential'") == 1


# ---- validation_metric_names and _check_monitored_keys -----------------------------------------------------
CLASSIFICATION_NAMES = {
    "val/acc_mean",
    "val/acc_last10",
    "val/acc_std",
    "val/acc_worst10",
    "val/acc_min",
    "val/acc_weighted",
    "val/loss",
}
REGRESSION_NAMES = {"val/mse_mean", "val/mse_last10", "val/mse_std", "val/mse_worst10", "val/mse_max"}


def test_validation_metric_names_classification() -> None:
    module = make_module()
    module.fed = digits_fed()
    assert module.validation_metric_names() == CLASSIFICATION_NAMES


def test_validation_metric_names_regression() -> None:
    module = FederatedModule(FedAvg(1), nn.Linear(4, 1))
    module.fed = regression_fed()
    assert module.validation_metric_names() == REGRESSION_NAMES


def test_dist_b_needs_both_b_star_and_a_representation() -> None:
    b_star = torch.eye(4)[:, :2]
    with_rep = FederatedModule(FedAvg(1), LinearRepresentation(dim=4, rank=2))
    with_rep.fed = regression_fed({"B_star": b_star})
    assert with_rep.validation_metric_names() == REGRESSION_NAMES | {"val/dist_B"}
    with_rep.fed = regression_fed()  # a representation but no ground truth
    assert with_rep.validation_metric_names() == REGRESSION_NAMES
    plain = FederatedModule(FedAvg(1), nn.Linear(4, 1))  # ground truth but no representation
    plain.fed = regression_fed({"B_star": b_star})
    assert plain.validation_metric_names() == REGRESSION_NAMES


def attached(module: FederatedModule, **trainer: Any) -> FederatedModule:
    module.trainer = SimpleNamespace(**trainer)
    return module


def test_monitoring_a_logged_key_is_accepted() -> None:
    module = make_module()
    module.fed = digits_fed()
    callbacks = [SimpleNamespace(monitor=k) for k in sorted(CLASSIFICATION_NAMES)]
    callbacks += [SimpleNamespace(monitor="train/loss"), SimpleNamespace(monitor=None), SimpleNamespace()]
    attached(module, callbacks=callbacks)._check_monitored_keys()


@pytest.mark.parametrize("monitor", ["val/mse_mean", "val/nope"])
def test_monitoring_a_val_key_that_is_never_logged_is_refused(monitor: str) -> None:
    module = make_module()
    module.fed = digits_fed()
    attached(module, callbacks=[SimpleNamespace(monitor=monitor)])
    with pytest.raises(ConfigError, match="which is never logged"):
        module._check_monitored_keys()


# ---- set-up hooks -------------------------------------------------------------------------------------------
def fake_datamodule(fed: FederatedData) -> SimpleNamespace:
    return SimpleNamespace(federated=fed)


def test_setup_without_a_datamodule_attribute_is_a_config_error() -> None:
    module = attached(make_module(), precision="32-true")
    with pytest.raises(ConfigError, match="needs a FederatedDataModule"):
        module.setup("fit")


def test_setup_with_a_datamodule_that_is_not_federated_is_a_config_error() -> None:
    module = attached(make_module(), datamodule=SimpleNamespace(), precision="32-true")
    with pytest.raises(ConfigError, match="needs a FederatedDataModule"):
        module.setup("fit")


@pytest.mark.parametrize("precision", ["16", 16, "16-mixed"])
def test_setup_refuses_fp16(precision: Any) -> None:
    module = attached(make_module(), datamodule=fake_datamodule(digits_fed()), precision=precision)
    with pytest.raises(ConfigError, match="16-mixed is not supported"):
        module.setup("fit")


def test_setup_schedules_validation_when_fitting_only() -> None:
    fitting = attached(
        make_module(eval_every=3),
        datamodule=fake_datamodule(digits_fed()),
        precision="32-true",
        val_check_interval=1.0,
        check_val_every_n_epoch=1,
    )
    fitting.setup("fit")
    assert (fitting.trainer.val_check_interval, fitting.trainer.check_val_every_n_epoch) == (3, None)
    assert fitting.fed is not None and fitting.bank is not None
    validating = attached(
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
        module = attached(make_module(), val_check_interval=5, check_val_every_n_epoch=ok)
        module._schedule_validation()
        assert (module.trainer.val_check_interval, module.trainer.check_val_every_n_epoch) == (5, ok)
    for bad in (2, 0):
        module = attached(make_module(), val_check_interval=5, check_val_every_n_epoch=bad)
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
    attached(module, callbacks=[])
    before = time.perf_counter()
    module.on_fit_start()
    wall = module.wall_seconds()
    elapsed = time.perf_counter() - before
    assert module.fed.train.x.device.type == "meta" and module.fed.test.y.device.type == "meta"
    assert 0.0 < wall <= elapsed


def test_on_fit_start_refuses_a_monitored_key_never_logged() -> None:
    module = make_module()
    module.fed = digits_fed()
    attached(module, callbacks=[SimpleNamespace(monitor="val/mse_mean")])
    with pytest.raises(ConfigError, match="never logged"):
        module.on_fit_start()


def test_last_rounds_force_validation_only_there() -> None:
    module = attached(make_module(eval_last=2), max_steps=20, val_check_batch=5)
    batch = {"round": torch.tensor(3)}
    module.on_train_batch_start(batch, 0)
    assert module.trainer.val_check_batch == 5  # round 3 is not one of the last 2 of 20
    module.on_train_batch_start({"round": torch.tensor(18)}, 0)
    assert module.trainer.val_check_batch == 1
    timed = attached(make_module(eval_last=2), max_steps=20, val_check_batch=None)
    timed.on_train_batch_start({"round": torch.tensor(19)}, 0)
    assert timed.trainer.val_check_batch is None  # a time-based interval stays
