"""``engine/notes.py``: a run's one-line notes, each said once per run."""

from __future__ import annotations

import gc
import logging

import pytest

from fl_lightning.engine import notes


class Run:
    """Anything that lives as long as a run (the engine passes the run's network or module)."""


def test_a_note_is_said_once_per_run_and_again_for_another_run(caplog: pytest.LogCaptureFixture) -> None:
    first, second = Run(), Run()
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        assert notes.say_once(first, "executor", logging.INFO, "executor: %s", "stacked")
        assert not notes.say_once(first, "executor", logging.INFO, "executor: %s", "again")
        assert notes.say_once(first, "bn1d", logging.WARNING, "skipped")
        assert notes.say_once(second, "executor", logging.INFO, "executor: %s", "sequential")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "executor: stacked"), (logging.WARNING, "skipped"), (logging.INFO, "executor: sequential")
    ]  # fmt: skip


def test_a_finished_run_leaves_nothing_behind() -> None:
    """The record of what a run said goes with the run (no process-wide set that grows with every run)."""
    run = Run()
    notes.say_once(run, "note", logging.DEBUG, "x")
    assert run in notes._SAID
    del run
    gc.collect()
    assert not any(isinstance(owner, Run) for owner in list(notes._SAID.keys()))
