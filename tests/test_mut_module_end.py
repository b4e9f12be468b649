"""FederatedModule's end-of-fit summary and per-round/per-evaluation logging, driven directly (no trainer.fit):
``on_train_end`` (the summary row: final, last10, best, metric, dist_B, new clients, "+FT", the final spread),
``on_validation_epoch_end``, ``validation_step``, ``on_validation_start``, ``_log_round``, ``_count_upload`` and
``wall_seconds``. Expected numbers are written out by hand or computed with plain numpy in the test."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from helpers import ranged_client_split as split
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine import evaluation
from fl_lightning.engine.aggregation import RoundStats
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import ClientEvaluation, FineTune
from fl_lightning.engine.module import FederatedModule
from fl_lightning.metrics import PerClientScores
from fl_lightning.models import DigitsMLP


def make_module(**kwargs: Any) -> FederatedModule:
    return FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **kwargs)


def digits_fed(val: bool = False) -> FederatedData:
    return FederatedData(
        split([3, 2, 2, 2], 64, True),
        split([2, 2, 2, 2], 64, True),
        10,
        val=split([1, 1, 1, 1], 64, True) if val else None,
    )


def regression_fed() -> FederatedData:
    return FederatedData(split([3, 2, 2, 2], 4, False), split([2, 2, 2, 2], 4, False), None)


class Recorder:
    """Stands in for a method: records each call's arguments and returns a fixed value."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.result = result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result


def population_std(values: list[float]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean((arr - arr.mean()) ** 2)))


# ---- on_train_end ------------------------------------------------------------------------------------------
ACC = [0.5, 1.0, 0.25, 0.75]  # the last evaluation's per-client accuracies (4 clients, all with test data)
LOSS = [0.4, 0.1, 0.9, 0.3]


def last_evaluation(round_idx: int, acc: list[float] = ACC, loss: list[float] = LOSS) -> ClientEvaluation:
    return ClientEvaluation(
        round_idx,
        torch.tensor(acc, dtype=torch.float64),
        torch.tensor(loss, dtype=torch.float64),
        sum(acc) / len(acc),
        sum(acc) / len(acc),
        sum(loss) / len(loss),
        torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64),
    )


def ending(
    fed: FederatedData,
    history: list[dict[str, float]],
    end: dict[str, float] | None = None,
    rounds: int = 6,
    **kwargs: Any,
) -> tuple[FederatedModule, Recorder, Recorder]:
    """A module at the end of ``rounds`` rounds with ``history``; ``_end_evaluations`` returns ``end``."""
    module = make_module(**kwargs)
    module.fed = fed
    module.history = history
    module.rounds_trained = rounds
    module.upload_bytes = 1234.0
    module._wall_before = 3.5  # resumed: 3.5 s before, and this process never started its clock
    module.last_evaluation = last_evaluation(rounds - 1) if history else None
    logger = SimpleNamespace(log_metrics=Recorder())
    module.trainer = SimpleNamespace(loggers=[logger])
    stub = Recorder(dict(end or {}))
    module._end_evaluations = stub
    module.on_train_end()
    return module, stub, logger.log_metrics


def acc_history() -> list[dict[str, float]]:
    return [
        {"round": 1.0, "val/acc_mean": 0.30},
        {"round": 3.0, "val/acc_mean": 0.80},
        {"round": 4.0, "val/acc_mean": 0.50},
        {"round": 5.0, "val/acc_mean": 0.60, "val/dist_B": 0.125},
    ]


def test_summary_of_a_classification_run() -> None:
    module, stub, log_metrics = ending(digits_fed(), acc_history(), eval_last=3)
    s = module.summary
    assert s["algorithm"] == "FedAvg"  # no "+FT" without finetune
    assert s["rounds"] == 6
    assert s["final"] == 0.60
    assert_close_finite(s["last10"], (0.80 + 0.50 + 0.60) / 3)  # the last eval_last=3 evaluations
    assert s["best"] == 0.80  # accuracy: the highest
    assert s["wall_s"] == 3.5
    assert s["upload_bytes"] == 1234.0
    assert s["metric"] == "acc"
    assert s["dist_B"] == 0.125
    assert "plain_final" not in s and "final_ft" not in s and "new_clients_acc" not in s
    # the final spread is that of the last evaluation (round 5 = rounds - 1)
    assert module.final_clients is module.last_evaluation
    assert_close_finite(s["final_std"], population_std(ACC))
    assert s["final_worst10"] == 0.25  # ceil(10 % of 4) = 1 client: the lowest accuracy
    assert s["final_min"] == 0.25
    # the end evaluations are of the last trained round, on the validation split; nothing to log
    assert stub.calls == [((5,), {"split": "test"})]
    assert log_metrics.calls == []


def test_summary_last10_with_one_evaluation_and_eval_last_larger_than_history() -> None:
    module, _, _ = ending(digits_fed(), [{"round": 5.0, "val/acc_mean": 0.6}], eval_last=10)
    assert module.summary["last10"] == 0.6
    assert module.summary["best"] == 0.6
    assert "dist_B" not in module.summary


def test_summary_last10_counts_the_last_evaluations_from_the_end() -> None:
    history = [{"round": float(r), "val/acc_mean": v} for r, v in enumerate([0.1, 0.2, 0.4, 0.9, 0.5], start=1)]
    module, _, _ = ending(digits_fed(), history, eval_last=2)
    assert_close_finite(module.summary["last10"], (0.9 + 0.5) / 2)


def test_summary_of_a_regression_run_reads_mse_lower_is_better() -> None:
    history = [
        {"round": 2.0, "val/mse_mean": 0.50},
        {"round": 4.0, "val/mse_mean": 0.20},
        {"round": 5.0, "val/mse_mean": 0.30},
    ]
    module, _, _ = ending(regression_fed(), history, eval_last=2)
    s = module.summary
    assert s["metric"] == "mse"
    assert s["final"] == 0.30
    assert_close_finite(s["last10"], 0.25)
    assert s["best"] == 0.20  # the lowest error
    assert_close_finite(s["final_std"], population_std(LOSS))
    assert s["final_worst10"] == 0.9 and s["final_max"] == 0.9  # the highest error
    assert "final_min" not in s


def test_summary_without_any_evaluation() -> None:
    module, stub, _ = ending(digits_fed(), [], rounds=3)
    s = module.summary
    assert math.isnan(s["final"]) and isinstance(s["final"], float)
    assert math.isnan(s["best"]) and isinstance(s["best"], float)
    assert s["last10"] == 0.0  # an empty sum over max(0, 1)
    assert s["rounds"] == 3 and s["metric"] == "acc"
    assert module.final_clients is None
    assert not any(k.startswith("final_") for k in s)
    assert stub.calls[0][0] == (2,)


def test_summary_leaves_out_a_stale_final_spread() -> None:
    """The last evaluation is not of the last round (no validation after it): no final_* spread."""
    module = make_module()
    module.fed, module.history, module.rounds_trained = digits_fed(), acc_history(), 8
    module.last_evaluation = last_evaluation(5)
    module.trainer = SimpleNamespace(loggers=[])
    module._end_evaluations = Recorder({})
    module.on_train_end()
    assert module.final_clients is module.last_evaluation
    assert not any(k.startswith("final_") for k in module.summary)
    assert module.summary["final"] == 0.60


def test_summary_with_finetune_keeps_the_plain_and_finetuned_figures_apart() -> None:
    """Issue 31: final/last10/best and final_{std,worst10,min} stay the plain run's; "+FT" is final_ft(_*)."""
    ft_acc = [1.0, 0.5, 0.5, 1.0]
    ft = last_evaluation(5, acc=ft_acc)
    module = make_module(finetune=FineTune(epochs=1), eval_last=2)
    module.fed, module.history, module.rounds_trained = digits_fed(val=True), acc_history(), 6
    module.last_evaluation = last_evaluation(5)
    logger = SimpleNamespace(log_metrics=Recorder())
    module.trainer = SimpleNamespace(loggers=[logger])
    end = {"final/acc_ft": 0.875, "final/new_clients_acc": 0.625}

    def end_evaluations(round_idx: int, split: str) -> dict[str, float]:
        module.finetuned_clients = ft
        assert (round_idx, split) == (5, "val")
        return dict(end)

    module._end_evaluations = end_evaluations
    module.on_train_end()
    s = module.summary
    assert s["algorithm"] == "FedAvg+FT"
    assert s["final"] == 0.60 and s["best"] == 0.80
    assert_close_finite(s["last10"], (0.50 + 0.60) / 2)
    assert s["final_ft"] == 0.875
    assert "plain_final" not in s and "plain_last10" not in s
    assert s["new_clients_acc"] == 0.625
    assert module.final_clients is ft
    assert_close_finite(s["final_std"], population_std(ACC))  # the plain last evaluation's clients
    assert s["final_min"] == 0.25
    assert_close_finite(s["final_ft_std"], population_std(ft_acc))  # the fine-tuned clients
    assert s["final_ft_min"] == 0.5
    assert logger.log_metrics.calls == [((end,), {"step": 5})]


def test_summary_names_the_new_clients_error_of_a_regression_run() -> None:
    history = [{"round": 5.0, "val/mse_mean": 0.4}]
    module, _, log_metrics = ending(regression_fed(), history, {"final/new_clients_mse": 0.75})
    assert module.summary["new_clients_mse"] == 0.75
    assert "new_clients_acc" not in module.summary
    assert log_metrics.calls == [(({"final/new_clients_mse": 0.75},), {"step": 5})]


# ---- on_validation_epoch_end -------------------------------------------------------------------------------
def validating(fn: TrainerFn, sanity: bool = False, **kwargs: Any) -> tuple[FederatedModule, Recorder, Recorder]:
    """A module after round 4 whose 4 clients scored 1/2, 2/2, 0/2 and 1/2 (accuracy mean 0.5)."""
    module = make_module(**kwargs)
    module.fed = digits_fed()
    module.rounds_trained = 5
    module.client_scores = PerClientScores(4)
    for c, correct in enumerate([1.0, 2.0, 0.0, 1.0]):
        module.client_scores.update(c, correct, 2, 0.5 * (c + 1))
    module.trainer = SimpleNamespace(sanity_checking=sanity, state=SimpleNamespace(fn=fn))
    log_dict, log = Recorder(), Recorder()
    module.log_dict, module.log = log_dict, log
    return module, log_dict, log


def test_validation_epoch_end_logs_the_evaluation_on_the_progress_bar_with_its_round() -> None:
    module, log_dict, log = validating(TrainerFn.FITTING, eval_last=2)
    module.history = [{"round": 2.0, "val/acc_mean": 0.25}, {"round": 3.0, "val/acc_mean": 0.75}]
    module.on_validation_epoch_end()
    assert len(log_dict.calls) == 1
    (metrics,), kwargs = log_dict.calls[0]
    assert kwargs == {"prog_bar": True}
    assert_close_finite(metrics["val/acc_mean"], 0.5)
    assert_close_finite(metrics["val/acc_last10"], (0.75 + 0.5) / 2)  # this one and the one before
    assert_close_finite(metrics["val/loss"], np.mean([0.5 / 2, 1.0 / 2, 1.5 / 2, 2.0 / 2]))
    assert log.calls == [(("round", 4.0), {})]
    assert module.history[-1]["round"] == 4 and len(module.history) == 3


def test_validation_epoch_end_outside_fit_has_no_last10_and_keeps_history() -> None:
    module, log_dict, log = validating(TrainerFn.VALIDATING)
    module.on_validation_epoch_end()
    (metrics,), kwargs = log_dict.calls[0]
    assert kwargs == {"prog_bar": True}
    assert "val/acc_last10" not in metrics
    assert module.history == []
    assert log.calls == [(("round", 4.0), {})]


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
    module.fed = digits_fed(val=val)
    module.rounds_trained = 7
    module.client_scores = PerClientScores(4)
    module.trainer = SimpleNamespace(sanity_checking=False)
    recorder = Recorder()
    monkeypatch.setattr(evaluation, "evaluate_clients", recorder)
    module.validation_step([1, 3], 0)
    assert recorder.calls == [((module, [1, 3], 6, module.client_scores), {"split": "val" if val else "test"})]


def test_validation_step_skips_the_sanity_check(monkeypatch: pytest.MonkeyPatch) -> None:
    module = make_module()
    module.fed = digits_fed()
    module.trainer = SimpleNamespace(sanity_checking=True)
    recorder = Recorder()
    monkeypatch.setattr(evaluation, "evaluate_clients", recorder)
    module.validation_step([0, 1], 0)
    assert recorder.calls == []


def test_validation_step_scores_each_client_on_its_val_rows() -> None:
    """The real evaluation: clients 0 and 2 are scored on their one validation row, not their two test rows."""
    module = make_module()
    module.attach_data(digits_fed(val=True))
    module.rounds_trained = 3
    module.trainer = SimpleNamespace(sanity_checking=False)
    module.validation_step([0, 2], 0)
    assert module.client_scores.total.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_validation_start_moves_the_data_to_the_module_device_and_dtype() -> None:
    module = FederatedModule(FedAvg(1), nn.Linear(64, 10).double())
    module.fed = digits_fed(val=True)
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
    module.log_dict = log_dict
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
    assert log_dict.calls[0] == (
        ({"faults/dropped": 1.0, "faults/non_finite": stats.non_finite, "faults/stragglers": 2.0},),
        {},
    )
    assert log_dict.calls[1][0][0]["round"] == 2.0


def test_count_upload_accumulates() -> None:
    module = make_module()
    assert module._count_upload(640) == 640.0
    assert module._count_upload(360.0) == 1000.0
    assert module.upload_bytes == 1000.0


# ---- wall_seconds ------------------------------------------------------------------------------------------
def test_wall_seconds_adds_this_process_to_the_resumed_time() -> None:
    module = make_module()
    module._wall_before = 5.0
    start = time.perf_counter()
    module._fit_start = start - 2.0  # this process started its clock 2 s ago
    wall = module.wall_seconds()
    elapsed = time.perf_counter() - start
    assert 7.0 - 1e-9 <= wall <= 7.0 + elapsed + 1e-9


def test_wall_seconds_before_the_clock_starts_is_the_resumed_time() -> None:
    module = make_module()
    module._wall_before = 5.0
    assert module.wall_seconds() == 5.0
