"""``fl_lightning.engine.lightning_logging``: Lightning's logged-metric move skipped only when nothing moves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedRep
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


# ---- log_scalars: one call per round, the same values as Lightning's log_dict ----------------------------------
def _fit_csv(fast: bool, root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, float], list[dict]]:
    """metrics.csv of a 3-round fit and test (faults on, so every round logs its fault counts too), the trainer's
    callback metrics, and the module's history; ``fast=False`` logs through Lightning's own ``log_dict``."""
    from lightning.pytorch.loggers import CSVLogger

    if not fast:

        def lightnings(self: FederatedModule, m: dict, prog_bar: bool | set = False) -> None:  # self.log per key
            for k, v in m.items():
                self.log(k, v, prog_bar=prog_bar if isinstance(prog_bar, bool) else k in prog_bar)

        monkeypatch.setattr(FederatedModule, "log_scalars", lightnings)
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)), client_dropout=0.2, stragglers=0.3)
    trainer = make_trainer(3, logger=CSVLogger(str(root), name="", version=""), log_every_n_steps=1)
    trainer.fit(module, datamodule=dm)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    logged |= {f"progress bar: {k}": float(v) for k, v in trainer.progress_bar_metrics.items()}
    fitted = (root / "metrics.csv").read_text()
    trainer.test(module, datamodule=dm, verbose=False)
    monkeypatch.undo()
    return fitted + (root / "metrics.csv").read_text(), logged, module.history


def test_log_scalars_writes_the_same_metrics_csv_and_callback_metrics_as_log_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast_csv, fast_logged, fast_history = _fit_csv(True, tmp_path / "fast", monkeypatch)
    csv, logged, history = _fit_csv(False, tmp_path / "lightning", monkeypatch)
    assert fast_csv == csv  # byte for byte: columns, rows, float32 values
    header = csv.splitlines()[0].split(",")
    assert {"train/loss", "faults/dropped", "val/acc_mean", "round", "step", "epoch"} <= set(header)
    assert "test/acc_mean" in csv and len(csv.splitlines()) > 6  # training and validation rows, the test row
    assert fast_logged == logged and {"train/loss", "val/acc_mean", "faults/stragglers"} <= set(logged)
    assert "progress bar: val/acc_mean" in logged and "progress bar: round" not in logged
    assert fast_history == history and len(history) == 3


def test_log_scalars_registers_a_key_through_lightning_once_then_updates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's ``_ResultCollection.log`` sees each (hook, key) once, at its first round; later rounds update the
    metric it registered (and the CSV test above shows the same values reach the same places)."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    seen: list[tuple[str, str]] = []
    original = _ResultCollection.log

    def log(self, fx, name, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((fx, name))
        return original(self, fx, name, *args, **kwargs)

    monkeypatch.setattr(_ResultCollection, "log", log)
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    make_trainer(4).fit(module, datamodule=dm)
    assert ("training_step", "train/loss") in seen and ("on_validation_epoch_end", "val/acc_mean") in seen
    assert len(seen) == len(set(seen))


def test_a_key_logged_again_with_other_arguments_is_refused_as_lightning_refuses_it() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    calls: list[int] = []

    def log_twice(metrics: dict, prog_bar: bool = False) -> None:
        lightning_logging.log_scalars(module, metrics, prog_bar)
        if len(calls) == 0 and "train/loss" in metrics:
            calls.append(1)
            lightning_logging.log_scalars(module, {"train/loss": 1.0}, prog_bar=True)  # registered without

    module.log_scalars = log_twice
    with pytest.raises(MisconfigurationException, match="twice in `training_step` with different arguments"):
        make_trainer(2).fit(module, datamodule=dm)


class _LogsOutsideATrainer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict, bool]] = []
        self._trainer, self._fabric, self._current_fx_name = None, None, None

    def log_dict(self, metrics: dict, prog_bar: bool = False) -> None:
        self.calls.append((metrics, prog_bar))


def test_log_scalars_hands_anything_else_to_log_dict() -> None:
    """No trainer (or a value that is not a number or a one-element tensor): Lightning's ``log_dict`` decides."""
    module = _LogsOutsideATrainer()
    lightning_logging.log_scalars(module, {"a": 1.0, "b": torch.tensor(2.0)}, prog_bar=True)
    assert module.calls == [({"a": 1.0, "b": torch.tensor(2.0)}, True)]
    module.calls.clear()  # keys named for the progress bar: log_dict key by key, in order, each with its own
    lightning_logging.log_scalars(module, {"a": 1.0, "r": 3.0, "b": 2.0}, prog_bar={"a", "b"})
    assert module.calls == [({"a": 1.0}, True), ({"r": 3.0}, False), ({"b": 2.0}, True)]


# ---- cached signature reads ------------------------------------------------------------------------------------
def test_signature_reads_are_cached_per_function_and_answer_as_lightning() -> None:
    from lightning.pytorch.utilities import signature_utils

    reads: list[object] = []

    def read(fn, param, explicit=False, min_args=None):  # noqa: ANN001, ANN202
        reads.append(fn)
        return signature_utils.is_param_in_hook_signature(fn, param, explicit=explicit, min_args=min_args)

    cached = lightning_logging.cached_signature_reads(read)

    class Hooks:
        def step(self, batch, batch_idx, dataloader_iter=None): ...  # noqa: ANN001, ANN201
        def varargs(self, *args): ...  # noqa: ANN002, ANN201

    a, b = Hooks(), Hooks()
    questions = [("dataloader_iter", True, None), ("batch_idx", False, None), ("other", False, 2), ("other", True, 3)]
    for hook in (a.step, b.step, a.varargs, Hooks.step):
        for param, explicit, min_args in questions:
            want = signature_utils.is_param_in_hook_signature(hook, param, explicit=explicit, min_args=min_args)
            assert cached(hook, param, explicit=explicit, min_args=min_args) == want
    assert len(reads) == 2 * len(questions)  # step (bound twice and unbound: one function) and varargs
    assert cached.lightning_read is read


def test_install_caches_the_signature_reads_of_lightnings_per_batch_readers() -> None:
    import importlib

    assert lightning_logging.install()
    for name in lightning_logging.SIGNATURE_READERS:
        assert hasattr(importlib.import_module(name).is_param_in_hook_signature, "lightning_read"), name


# ---- LeanHooks: Lightning's per-batch plumbing ---------------------------------------------------------------
def test_validation_scores_and_modes_are_those_of_lightnings_eval_and_train_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With Lightning's own hooks (eval() of every submodule before each validation, the modes restored after)
    a fit records the same history, and the network is in train mode after each validation either way."""

    def run(lightning_hooks: bool) -> tuple[list[dict], list[bool]]:
        if lightning_hooks:
            for hook in ("on_validation_model_eval", "on_validation_model_train"):
                monkeypatch.setattr(FederatedModule, hook, getattr(L.LightningModule, hook))
        L.seed_everything(0, verbose=False)
        dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
        module = FederatedModule(FedRep(head_epochs=1, body_epochs=1), DigitsMLP(hidden=(8,)))
        modes: list[bool] = []
        original = module.on_validation_end

        def record() -> None:
            original()
            modes.append(module.net.training)

        module.on_validation_end = record
        make_trainer(3).fit(module, datamodule=dm)
        monkeypatch.undo()
        return module.history, modes + [module.net.training]

    ours, modes = run(False)
    theirs, _ = run(True)
    assert ours == theirs and len(ours) == 3
    assert all(modes) and len(modes) == 4  # after each of the 3 validations and at the end
