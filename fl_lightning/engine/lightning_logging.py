"""A cheaper ``self.log`` for the rounds: one call per round, Lightning's hook-signature reads cached, and its
logged-metric move skipped when nothing moves.

``log_scalars(module, metrics)`` is ``module.log_dict(metrics)`` for a dict of numbers and one-element tensors
(what a round and an evaluation log): the checks ``LightningModule.log`` repeats for every key (the hook's logging
levels, the ``training_step`` signature, the result collection's reset) are done once per call, every number
becomes a tensor in one ``torch.tensor`` call (the dtype and device ``self.log`` gives it), and each key then goes
to the loop's result collection (``_ResultCollection.log``) with the arguments ``self.log`` would pass, so the
trainer's ``callback_metrics``, the progress bar and every logger see the same values. Anything else (a
``Metric``, Fabric, no trainer) takes ``log_dict``'s own path.

Lightning reads the signature of ``training_step`` (``is_param_in_hook_signature``, one ``inspect.getfullargspec``)
at every ``self.log`` call and for every batch; ``install()`` caches that answer per function.

Every ``LightningModule.log`` call ends in ``_ResultMetric.to(value.device)``, which rebuilds the logged metric's
whole ``__dict__`` with ``apply_to_collection`` (its states, the ``nn.Module`` dictionaries, the ``_Metadata``
dataclass) even when every tensor is already on that device. A federated round logs about 15 scalars (training,
communication and validation metrics), so on the CPU that walk was a sixth of a batched digits job's time
(py-spy profiles of ``python -m benchmarks.batched_runs``; ``benchmarks/batched_runs.py`` measures the grids).

A key a round logs again with the same arguments (hook, progress bar, levels, reduction) is not handed to
``_ResultCollection.log`` again, which would build a new ``_Metadata``, compare it with the stored one and move the
metric: ``update_logged`` does what that call then does (the move when one is needed, the batch size, the metric's
update). A key logged with other arguments still goes to Lightning, which refuses it as ``self.log`` does.

``LeanHooks`` (mixed into ``FederatedModule``) skips per-batch work the module's evaluation leaves idle: the
``eval()``/``train()`` walk around each validation (evaluation sets the network's mode).

``install()`` wraps ``_ResultMetric.to``: when the move names one device and every tensor the metric holds is on
it, the metric is returned as it is (the move would have produced the same tensors); otherwise Lightning's own
``to`` runs. It is installed for the Lightning versions pyproject.toml allows (2.6), whose ``_ResultMetric`` the
tests check against (``tests/engine/test_lightning_logging.py``); any other version keeps Lightning's method.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any

import lightning
import torch
from lightning.pytorch import LightningModule
from torch import Tensor

SUPPORTED = ("2.6.",)  #: the Lightning versions whose ``_ResultMetric.to`` this wraps (pyproject: >=2.6.4,<2.7)


#: where a Lightning 2.6 ``_ResultMetric`` keeps tensors: its states (``add_state``), their defaults, the last step's
#: value and the computed result (``tests/engine/test_lightning_logging.py`` walks every attribute to check it)
STATES = ("value", "cumulated_batch_size", "_forward_cache", "_computed")


def metric_on(metric: Any, device: torch.device) -> bool:
    """Whether every tensor of a logged metric is on ``device`` (anything else where a tensor may be: no)."""
    held = metric.__dict__
    for values in ((held.get(name) for name in STATES), held.get("_defaults", {}).values()):
        for value in values:
            if isinstance(value, Tensor):
                if value.device != device:
                    return False
            elif value is not None and not isinstance(value, (int, float)):
                return False
    return True


def skip_idle_moves(to: Callable[..., Any]) -> Callable[..., Any]:
    """``to`` that returns the metric unchanged when ``to(device)`` would move nothing."""

    def move(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], (torch.device, str)):
            device = torch.device(args[0])
            if metric_on(self, device):
                return self
        return to(self, *args, **kwargs)

    move.lightning_to = to  # type: ignore[attr-defined]
    return move


#: the Lightning modules that read hook signatures per batch or per ``self.log`` (``install`` caches their reads)
SIGNATURE_READERS = (
    "lightning.pytorch.core.module",
    "lightning.pytorch.loops.training_epoch_loop",
    "lightning.pytorch.loops.evaluation_loop",
    "lightning.pytorch.loops.utilities",
    "lightning.pytorch.core.optimizer",
)


def cached_signature_reads(read: Callable[..., bool]) -> Callable[..., bool]:
    """``is_param_in_hook_signature`` answered once per (function, question): a function's signature does not
    change. Bound methods are keyed by their function; anything unhashable is read every time."""

    @functools.lru_cache(maxsize=1024)
    def cached(fn: Any, param: str, explicit: bool, min_args: int | None) -> bool:
        return read(fn, param, explicit=explicit, min_args=min_args)

    def is_param_in_hook_signature(hook_fx: Callable, param: str, explicit: bool = False,
                                   min_args: int | None = None) -> bool:  # fmt: skip
        fn = getattr(hook_fx, "__func__", hook_fx)
        try:
            return cached(fn, param, explicit, min_args)
        except TypeError:  # unhashable
            return read(hook_fx, param, explicit=explicit, min_args=min_args)

    is_param_in_hook_signature.lightning_read = read  # type: ignore[attr-defined]
    return is_param_in_hook_signature


def install() -> bool:
    """Wrap ``_ResultMetric.to`` and cache the hook-signature reads once (a supported Lightning version); True
    when the wrappers are in place."""
    import importlib

    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    if hasattr(_ResultMetric.to, "lightning_to"):
        return True
    if not lightning.__version__.startswith(SUPPORTED):
        return False
    _ResultMetric.to = skip_idle_moves(_ResultMetric.to)
    for name in SIGNATURE_READERS:
        module = importlib.import_module(name)
        read = module.is_param_in_hook_signature
        if not hasattr(read, "lightning_read"):
            module.is_param_in_hook_signature = cached_signature_reads(read)
    return True


def log_scalars(module: LightningModule, metrics: Mapping[str, Any], prog_bar: bool | Collection[str] = False) -> None:
    """``module.log_dict(metrics, prog_bar=prog_bar)`` for numbers and one-element tensors, with ``self.log``'s
    per-call work done once (see the module docstring); the same values reach the same places. ``prog_bar`` may
    name the keys that go to the progress bar (then each key is logged as ``self.log`` with its own ``prog_bar``)."""
    from lightning.pytorch.trainer.connectors.logger_connector.fx_validator import _FxValidator
    from lightning.pytorch.trainer.connectors.logger_connector.result import _get_default_dtype

    trainer, fx = module._trainer, module._current_fx_name
    plain = all(isinstance(v, numbers.Number) or (isinstance(v, Tensor) and v.numel() == 1) for v in metrics.values())
    if (
        not plain
        or not lightning.__version__.startswith(SUPPORTED)
        or module._fabric is not None
        or trainer is None
        or trainer.barebones
        or trainer._results is None
        or fx is None
        or any("/dataloader_idx_" in k for k in metrics)
        or (trainer.training and module_reads_dataloader_iter(module))
    ):
        if isinstance(prog_bar, bool):
            module.log_dict(dict(metrics), prog_bar=prog_bar)
        else:  # log_dict is self.log key by key: the same, each key with its own prog_bar
            for name, value in metrics.items():
                module.log_dict({name: value}, prog_bar=name in prog_bar)
        return
    on_step, on_epoch = _FxValidator.check_logging_and_get_default_levels(fx, on_step=None, on_epoch=None)
    numbers_at = [k for k, v in metrics.items() if not isinstance(v, Tensor)]
    converted = dict(zip(numbers_at, torch.tensor(
        [metrics[k] for k in numbers_at], device=module.device, dtype=_get_default_dtype()
    ).unbind())) if numbers_at else {}  # fmt: skip
    results = trainer._results
    if trainer._logger_connector.should_reset_tensors(fx):
        results.reset(metrics=False, fx=fx)
    reduce = trainer.strategy.reduce
    suffix = "" if results.dataloader_idx is None else f".{results.dataloader_idx}"
    for name, value in metrics.items():
        value = converted[name] if name in converted else value.clone().detach().squeeze()
        shown = prog_bar if isinstance(prog_bar, bool) else name in prog_bar
        signature = (shown, on_step, on_epoch, reduce)
        metric = results.get(f"{fx}.{name}{suffix}")
        if metric is not None and metric.__dict__.get(LOGGED_AS) == signature:
            update_logged(results, metric, value)
            continue
        results.log(fx, name, value, prog_bar=shown, logger=True, on_step=on_step, on_epoch=on_epoch,
                    reduce_fx="mean", enable_graph=False, add_dataloader_idx=True, batch_size=None, sync_dist=False,
                    sync_dist_fn=reduce, sync_dist_group=None, metric_attribute=None, rank_zero_only=False)  # fmt: skip
        results[f"{fx}.{name}{suffix}"].__dict__[LOGGED_AS] = signature
    if metrics:  # what each of Lightning's ``self.log`` calls ends with, once for the call
        trainer._logger_connector._current_fx = fx


#: where ``log_scalars`` notes, on a logged metric, the arguments Lightning registered it with (its ``_Metadata``
#: is then known to equal what the same call would build again)
LOGGED_AS = "_fl_logged_as"


def update_logged(results: Any, metric: Any, value: Tensor) -> None:
    """What ``_ResultCollection.log`` does for a key it already holds with the same metadata: move the metric to the
    value's device, take the batch size, update the metric (``update_metrics``), without building and comparing a
    new ``_Metadata``."""
    if not metric_on(metric, value.device):  # else ``to`` would return the metric as it is (``skip_idle_moves``)
        metric.to(value.device)
    batch_size = results._extract_batch_size(metric, None, metric.meta)
    metric.forward(value, batch_size)
    metric.has_reset = False


def module_reads_dataloader_iter(module: LightningModule) -> bool:
    """Whether ``training_step`` takes ``dataloader_iter`` (then ``self.log`` asks for a batch size: its own path)."""
    from lightning.pytorch.core import module as lightning_module

    return lightning_module.is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


class LeanHooks:
    """Lightning's per-batch plumbing where a federated module's batches and evaluation leave it idle (mixed into
    ``FederatedModule`` before ``LightningModule``). ``transfer_batch_to_device`` is not among them: overriding it
    makes Lightning warn on every fit with a DataModule, which its small per-round saving does not justify; nor is
    ``__setattr__`` (a plain attribute set without ``nn.Module``'s checks saved about 1 µs a set, and put this file
    into every round: ``tools/round_files.py``)."""

    def on_validation_model_eval(self) -> None:
        """Nothing: every evaluation path puts the network in eval mode itself and restores its mode
        (``evaluation.evaluate_clients``), so Lightning's ``eval()`` of every submodule before each validation and the
        mode restore after it (``on_validation_model_train``) are skipped."""

    def on_validation_model_train(self) -> None:
        """Nothing (see ``on_validation_model_eval``)."""
