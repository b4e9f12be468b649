"""Stand-ins for Lightning objects in the engine's unit tests: a hook of ``FederatedModule`` (or a DataModule) reads
only a few trainer attributes, so a test drives the hook with exactly those instead of a whole ``Trainer``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, TypeVar

T = TypeVar("T")


def with_trainer(owner: T, **attributes: Any) -> T:
    """``owner`` (a LightningModule or LightningDataModule) attached to a stand-in trainer that has exactly
    ``attributes`` (a missing one raises ``AttributeError``, as a hook reading more than it should must fail)."""
    owner.trainer = SimpleNamespace(**attributes)
    return owner


class Recorder:
    """Stands in for a method: records each call's arguments and returns a fixed value."""

    def __init__(self, result: Any = None) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.result = result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        return self.result
