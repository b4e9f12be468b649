"""``fl_lightning/engine/summary.py``: the run summary ``on_train_end`` writes (final, last10, best, the spread over
clients, "+FT" and new-client figures), for classification and regression runs, against hand-computed values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.module import FederatedModule
from tests.helpers.asserts import assert_close_finite
from tests.helpers.small_modules import (
    ACC,
    LOSS,
    digits_fed_2,
    last_evaluation,
    make_module,
    regression_fed_2,
)
from tests.helpers.stand_ins import Recorder, with_trainer


def population_std(values: list[float]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean((arr - arr.mean()) ** 2)))


def ending(
    fed: FederatedData,
    history: list[dict[str, float]],
    end: dict[str, float] | None = None,
    rounds: int = 6,
    **kwargs: Any,
) -> tuple[FederatedModule, Recorder, Recorder]:
    """A module at the end of ``rounds`` rounds with ``history``; ``end_evaluations`` returns ``end``."""
    module = make_module(**kwargs)
    module.fed = fed
    module.history = history
    module.rounds_trained = rounds
    module.upload_bytes = 1234.0
    module.resumed_wall_s = 3.5  # resumed: 3.5 s before, and this process never started its clock
    module.last_evaluation = last_evaluation(rounds - 1) if history else None
    logger = SimpleNamespace(log_metrics=Recorder())
    with_trainer(module, loggers=[logger])
    stub = Recorder(dict(end or {}))
    module.end_evaluations = stub
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
    module, stub, log_metrics = ending(digits_fed_2(), acc_history(), eval_last=3)
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
    module, _, _ = ending(digits_fed_2(), [{"round": 5.0, "val/acc_mean": 0.6}], eval_last=10)
    assert module.summary["last10"] == 0.6
    assert module.summary["best"] == 0.6
    assert "dist_B" not in module.summary


def test_summary_last10_counts_the_last_evaluations_from_the_end() -> None:
    history = [{"round": float(r), "val/acc_mean": v} for r, v in enumerate([0.1, 0.2, 0.4, 0.9, 0.5], start=1)]
    module, _, _ = ending(digits_fed_2(), history, eval_last=2)
    assert_close_finite(module.summary["last10"], (0.9 + 0.5) / 2)


def test_summary_of_a_regression_run_reads_mse_lower_is_better() -> None:
    history = [
        {"round": 2.0, "val/mse_mean": 0.50},
        {"round": 4.0, "val/mse_mean": 0.20},
        {"round": 5.0, "val/mse_mean": 0.30},
    ]
    module, _, _ = ending(regression_fed_2(), history, eval_last=2)
    s = module.summary
    assert s["metric"] == "mse"
    assert s["final"] == 0.30
    assert_close_finite(s["last10"], 0.25)
    assert s["best"] == 0.20  # the lowest error
    assert_close_finite(s["final_std"], population_std(LOSS))
    assert s["final_worst10"] == 0.9 and s["final_max"] == 0.9  # the highest error
    assert "final_min" not in s


def test_summary_without_any_evaluation() -> None:
    module, stub, _ = ending(digits_fed_2(), [], rounds=3)
    s = module.summary
    assert "final" not in s and "best" not in s and "last10" not in s  # nothing to report, not NaN or a fake 0
    assert s["evaluations"] == 0
    assert s["rounds"] == 3 and s["metric"] == "acc"
    assert module.final_clients is None
    assert not any(k.startswith("final_") for k in s)
    assert stub.calls[0][0] == (2,)


def test_summary_leaves_out_a_stale_final_spread() -> None:
    """The last evaluation is not of the last round (no validation after it): no final_* spread."""
    module = make_module()
    module.fed, module.history, module.rounds_trained = digits_fed_2(), acc_history(), 8
    module.last_evaluation = last_evaluation(5)
    with_trainer(module, loggers=[])
    module.end_evaluations = Recorder({})
    module.on_train_end()
    assert module.final_clients is module.last_evaluation
    assert not any(k.startswith("final_") for k in module.summary)
    assert module.summary["final"] == 0.60


def test_summary_names_the_new_clients_error_of_a_regression_run() -> None:
    history = [{"round": 5.0, "val/mse_mean": 0.4}]
    module, _, log_metrics = ending(regression_fed_2(), history, {"final/new_clients_mse": 0.75})
    assert module.summary["new_clients_mse"] == 0.75
    assert "new_clients_acc" not in module.summary
    assert log_metrics.calls == [(({"final/new_clients_mse": 0.75},), {"step": 5})]


def test_summary_with_finetune_keeps_the_plain_and_finetuned_figures_apart() -> None:
    """Issue 31: final/last10/best and final_{std,worst10,min} stay the plain run's; "+FT" is final_ft(_*)."""
    ft_acc = [1.0, 0.5, 0.5, 1.0]
    ft = last_evaluation(5, acc=ft_acc)
    module = make_module(finetune=FineTune(epochs=1), eval_last=2)
    module.fed, module.history, module.rounds_trained = digits_fed_2(val=True), acc_history(), 6
    module.last_evaluation = last_evaluation(5)
    logger = SimpleNamespace(log_metrics=Recorder())
    with_trainer(module, loggers=[logger])
    end = {"final/acc_ft": 0.875, "final/new_clients_acc": 0.625}

    def end_evaluations(round_idx: int, split: str) -> dict[str, float]:
        module.finetuned_clients = ft
        assert (round_idx, split) == (5, "val")
        return dict(end)

    module.end_evaluations = end_evaluations
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
