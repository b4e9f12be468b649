"""A run's one-line notes, each said once per run: the path it trains on, a fallback, a skipped minibatch.

The one "log once" of the engine: ``say_once(run, key, …)`` logs the first time ``key`` is seen for ``run`` (any
object that lives as long as the run: its ``FederatedModule``, or the network every context of the run shares), so
the second run of a process, or the last run of a batched job, says its own notes in its own log.
"""

from __future__ import annotations

import logging
import weakref

log = logging.getLogger("fl_lightning")

_SAID: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()


def say_once(run: object, key: str, level: int, message: str, *args: object) -> bool:
    """Log ``message % args`` at ``level`` if ``run`` has not said ``key`` yet; whether it was said now."""
    said = _SAID.setdefault(run, set())
    if key in said:
        return False
    said.add(key)
    log.log(level, message, *args)
    return True
