"""``fl_lightning.engine.lightning_logging``: Lightning's logged-metric move skipped only when nothing moves."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg
from fl_lightning.engine import lightning_logging
from fl_lightning.engine.lightning_logging import skip_idle_moves, tensors_on
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.training import make_trainer

CPU, META = torch.device("cpu"), torch.device("meta")


@dataclasses.dataclass
class Holder:
    inner: object


def test_tensors_on_looks_inside_containers_and_dataclasses() -> None:
    on_cpu = {"a": torch.zeros(2), "b": [torch.ones(1), (torch.zeros(()), 3)], "c": "text", "d": Holder(torch.ones(1))}
    assert tensors_on(on_cpu, CPU)
    assert not tensors_on(on_cpu, META)
    for where in ("a", "b", "d"):  # one tensor elsewhere, at each depth
        moved = dict(on_cpu)
        moved[where] = {"a": torch.zeros(2, device=META), "b": [torch.zeros(1, device=META)],
                        "d": Holder(torch.zeros(1, device=META))}[where]  # fmt: skip
        assert not tensors_on(moved, CPU), where
    assert tensors_on({"no": None, "tensors": [1, 2.0]}, META)
    assert not tensors_on({"module": torch.nn.Linear(1, 1)}, CPU)  # a nested metric or module always moves


def _metric() -> _ResultMetric:
    return _ResultMetric(_Metadata(fx="training_step", name="train/loss"), is_tensor=True)


def test_a_move_to_where_the_metric_is_returns_it_without_calling_lightning() -> None:
    calls = []

    def lightning_to(self, *args, **kwargs):
        calls.append(args)
        return self

    move = skip_idle_moves(lightning_to)
    metric = _metric()
    assert move(metric, CPU) is metric and move(metric, "cpu") is metric
    assert calls == []
    move(metric, META)  # elsewhere: Lightning's move
    move(metric, CPU, non_blocking=True)  # any other form of the call too
    move(metric, torch.float64)
    assert calls == [(META,), (CPU,), (torch.float64,)]


def test_a_metric_off_the_target_device_still_moves() -> None:
    metric = _metric()
    assert metric.value.device == CPU
    moved = metric.to(META)  # the installed wrapper (the engine installs it on import) falls through to Lightning
    assert moved.value.device == META and moved.cumulated_batch_size.device == META
    assert moved.to(META) is moved


def test_installed_for_the_pinned_lightning_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lightning_logging.install()  # the version pyproject.toml pins
    assert hasattr(_ResultMetric.to, "lightning_to")
    original = _ResultMetric.to.lightning_to
    monkeypatch.setattr(_ResultMetric, "to", original)
    monkeypatch.setattr(lightning_logging.lightning, "__version__", "2.7.0")
    assert not lightning_logging.install() and _ResultMetric.to is original


def _fit_logged(patched: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, float], list[dict]]:
    if not patched:
        monkeypatch.setattr(_ResultMetric, "to", _ResultMetric.to.lightning_to)
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    trainer = make_trainer(3)
    trainer.fit(module, datamodule=dm)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}  # the last round's training and validation
    tested = trainer.test(module, datamodule=dm, verbose=False)[0]
    monkeypatch.undo()
    return {**logged, **tested}, module.history


def test_a_fit_logs_the_same_metrics_with_and_without_the_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    with_wrapper, history = _fit_logged(True, monkeypatch)
    without, reference_history = _fit_logged(False, monkeypatch)
    assert hasattr(_ResultMetric.to, "lightning_to")  # put back
    assert with_wrapper.keys() == without.keys() and {"train/loss", "val/acc_mean", "test/acc_mean"} <= set(without)
    assert all(with_wrapper[k] == without[k] for k in without)
    assert history == reference_history and len(history) == 3
