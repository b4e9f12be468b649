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

from collections.abc import Callable
from typing import Any

import lightning
import torch
from torch import Tensor

SUPPORTED = ("2.6.",)  #: the Lightning versions whose ``_ResultMetric.to`` this wraps (pyproject: >=2.6.4,<2.7)


#: where a Lightning 2.6 ``_ResultMetric`` keeps tensors: its states (``add_state``), their defaults, the last step's
#: value and the computed result (``tests/engine/test_lightning_logging.py`` walks every attribute to check it)
STATES = ("value", "cumulated_batch_size", "_forward_cache", "_computed")


def metric_on(metric: Any, device: torch.device) -> bool:
    """Whether every tensor of a logged metric is on ``device`` (anything else where a tensor may be: no)."""
    held = metric.__dict__
    for value in [*(held.get(name) for name in STATES), *held.get("_defaults", {}).values()]:
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


def install() -> bool:
    """Wrap ``_ResultMetric.to`` once (a supported Lightning version); True when the wrapper is in place."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    if hasattr(_ResultMetric.to, "lightning_to"):
        return True
    if not lightning.__version__.startswith(SUPPORTED):
        return False
    _ResultMetric.to = skip_idle_moves(_ResultMetric.to)
    return True
