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
from fl_lightning.engine.lightning_logging import skip_idle_moves
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.training import make_trainer

CPU, META = torch.device("cpu"), torch.device("meta")


def tensor_paths(obj: object, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``obj`` through dicts, lists, tuples, dataclasses and modules' ``__dict__``,
    by path: the places Lightning's move (``apply_to_collection``) could touch."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if isinstance(obj, torch.nn.Module):
        return tensor_paths(obj.__dict__, path)
    items: list[tuple[str, object]] = []
    if isinstance(obj, dict):
        items = [(f"{path}.{k}", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return {k: t for name, v in items for k, t in tensor_paths(v, name).items()}


def test_metric_on_sees_every_tensor_a_logged_metric_holds() -> None:
    """After a fit and a test, every tensor of every metric Lightning logged sits where ``metric_on`` looks, and
    ``metric_on`` agrees with the full walk for the metric's device and another one."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    trainer = make_trainer(2)
    trainer.fit(module, datamodule=dm)
    metrics = [*trainer.fit_loop.epoch_loop._results.values(), *trainer.validate_loop._results.values()]
    trainer.test(module, datamodule=dm, verbose=False)
    metrics += list(trainer.test_loop._results.values())
    assert all(isinstance(m, _ResultMetric) for m in metrics)
    assert {"train/loss", "comm/upload_bytes", "test/acc_mean", "test/loss"} <= {m.meta.name for m in metrics}
    allowed = {f".{name}" for name in lightning_logging.STATES}
    for metric in metrics:
        found = tensor_paths(metric.__dict__)
        assert found and {p for p in found if not p.startswith("._defaults.")} <= allowed, sorted(found)
        assert lightning_logging.metric_on(metric, CPU) == all(t.device == CPU for t in found.values())
        assert not lightning_logging.metric_on(metric, META)


def test_metric_on_answers_no_for_a_state_elsewhere_or_of_unknown_kind() -> None:
    metric = _metric()
    assert lightning_logging.metric_on(metric, CPU)
    metric.__dict__["_forward_cache"] = torch.zeros((), device=META)
    assert not lightning_logging.metric_on(metric, CPU)
    metric.__dict__["_forward_cache"] = [torch.zeros(())]  # not a tensor, not a number: never skipped
    assert not lightning_logging.metric_on(metric, CPU)
    other = _metric()
    other._defaults["value"] = torch.zeros((), device=META)
    assert not lightning_logging.metric_on(other, CPU)


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
