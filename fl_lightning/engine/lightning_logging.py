"""A cheaper ``self.log`` for the rounds: Lightning's logged-metric move, skipped when nothing moves.

Every ``LightningModule.log`` call ends in ``_ResultMetric.to(value.device)``, which rebuilds the logged metric's
whole ``__dict__`` with ``apply_to_collection`` (its states, the ``nn.Module`` dictionaries, the ``_Metadata``
dataclass) even when every tensor is already on that device. A federated round logs about 15 scalars (training,
communication and validation metrics), so on the CPU that walk was a sixth of a batched digits job's time
(py-spy profiles of ``python -m benchmarks.batched_runs``; ``benchmarks/batched_runs.py`` measures the grids).

``install()`` wraps ``_ResultMetric.to``: when the move names one device and every tensor the metric holds is on
it, the metric is returned as it is (the move would have produced the same tensors); otherwise Lightning's own
``to`` runs. It is installed for the Lightning versions pyproject.toml allows (2.6), whose ``_ResultMetric`` the
tests check against (``tests/engine/test_lightning_logging.py``); any other version keeps Lightning's method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning
import torch
from torch import Tensor

SUPPORTED = ("2.6.",)  #: the Lightning versions whose ``_ResultMetric.to`` this wraps (pyproject: >=2.6.4,<2.7)


def tensors_on(obj: Any, device: torch.device) -> bool:
    """Whether every tensor in ``obj`` (tensors inside dicts, lists, tuples and dataclasses, as Lightning's move
    walks them) is on ``device``; an ``nn.Module`` (a nested metric) answers False, so its move is never skipped."""
    if isinstance(obj, Tensor):
        return obj.device == device
    if isinstance(obj, torch.nn.Module):
        return False
    if isinstance(obj, dict):
        return all(tensors_on(v, device) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(tensors_on(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return all(tensors_on(getattr(obj, f.name), device) for f in dataclasses.fields(obj))
    return True


def skip_idle_moves(to: Callable[..., Any]) -> Callable[..., Any]:
    """``to`` that returns the metric unchanged when ``to(device)`` would move nothing."""

    def move(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], (torch.device, str)):
            device = torch.device(args[0])
            if tensors_on(self.__dict__, device):
                return self
        return to(self, *args, **kwargs)

    move.lightning_to = to  # type: ignore[attr-defined]
    return move


def install() -> bool:
    """Wrap ``_ResultMetric.to`` once (a supported Lightning version); True when the wrapper is in place."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    if hasattr(_ResultMetric.to, "lightning_to"):
        return True
    if not lightning.__version__.startswith(SUPPORTED):
        return False
    _ResultMetric.to = skip_idle_moves(_ResultMetric.to)
    return True
