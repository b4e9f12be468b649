"""``fl_lightning/progress.py``: the one-line-per-N-rounds log (which rounds print, what a line says, a resumed run,
the main process only) driven by a stand-in trainer here, and the choice between the bar and the log."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
import torch

from fl_lightning import progress
from fl_lightning.progress import RoundLog, RoundProgressBar, round_progress


def _trainer(max_steps: int, step: int = 0, zero: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, max_steps=max_steps, is_global_zero=zero, callback_metrics={})


def _run(log: RoundLog, trainer: SimpleNamespace, rounds: range, capsys: pytest.CaptureFixture) -> list[str]:
    log.on_train_start(trainer, None)
    for done in rounds:  # the hook runs before each round, with the rounds done so far
        trainer.global_step = done
        trainer.callback_metrics = {"train/loss": torch.tensor(1.0 / (done + 1)), "val/acc_mean": torch.tensor(0.5)}
        log.on_train_batch_start(trainer, None, None, 0)
    trainer.global_step = rounds.stop
    log.on_train_end(trainer, None)
    return capsys.readouterr().out.splitlines()


def test_a_tenth_of_the_run_by_default_and_after_the_last_round(capsys: pytest.CaptureFixture) -> None:
    lines = _run(RoundLog(), _trainer(25), range(25), capsys)  # every ceil(25 / 10) = 3 rounds, then round 25
    assert [int(re.match(r"round (\d+)/25", ln).group(1)) for ln in lines] == [3, 6, 9, 12, 15, 18, 21, 24, 25]
    assert re.fullmatch(r"round 3/25  train/loss 0\.2500  val/acc_mean 0\.5000  \S+ s/round", lines[0])


def test_every_n_rounds_a_resumed_run_and_other_ranks(capsys: pytest.CaptureFixture) -> None:
    lines = _run(RoundLog(every_n_rounds=4), _trainer(12, step=8), range(8, 12), capsys)
    assert [ln.split()[1] for ln in lines] == ["12/12"]  # round 8 was printed before the stop, not again
    assert _run(RoundLog(every_n_rounds=1), _trainer(3, zero=False), range(3), capsys) == []
    quiet = RoundLog(every_n_rounds=1)
    quiet.disable()
    assert not quiet.is_enabled and _run(quiet, _trainer(3), range(3), capsys) == []
    with pytest.raises(ValueError, match="every_n_rounds must be ≥ 1, got 0"):
        RoundLog(every_n_rounds=0)


def test_a_bar_on_a_terminal_lines_in_a_log_file(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(progress.sys, "stdout", Terminal())
    assert isinstance(round_progress(), RoundProgressBar)
    monkeypatch.setattr(progress.sys, "stdout", io.StringIO())
    assert isinstance(round_progress(), RoundLog)
