"""``fl_lightning/loggers.py``: the CSV log a resumed run extends (rows before the resumed round kept, the recomputed
ones dropped), the W&B run id kept in the run dir, the states of a run dir and ``--overwrite``'s clearing, and
``clients.csv``; on run dirs written here."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from fl_lightning.experiment.collect import read_clients
from fl_lightning.loggers import (
    RUN_FILES,
    ResumableCSVLogger,
    clear_run_dir,
    run_dir_state,
    wandb_run_id,
    write_clients_csv,
)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_csv_log_keeps_the_rounds_before_the_checkpoint(tmp_path: Path) -> None:
    first = ResumableCSVLogger(str(tmp_path))
    for step in range(5):
        first.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    first.save()
    resumed = ResumableCSVLogger(str(tmp_path), resume=True)  # the checkpoint was at round 3: 3 and 4 are redone
    resumed.log_metrics({"train/loss": 0.5}, step=3)
    resumed.save()
    rows = _rows(tmp_path / "metrics.csv")
    assert [(r["step"], r["train/loss"]) for r in rows] == [("0", "1.0"), ("1", "0.5"), ("2", str(1 / 3)), ("3", "0.5")]
    fresh = ResumableCSVLogger(str(tmp_path))  # not resuming: the old file goes
    fresh.log_metrics({"train/loss": 9.0}, step=0)
    fresh.save()
    assert [(r["step"], r["train/loss"]) for r in _rows(tmp_path / "metrics.csv")] == [("0", "9.0")]


def test_the_wandb_run_id_is_kept_for_a_resume_and_new_otherwise(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    first = wandb_run_id(tmp_path / "run", resume=False)
    assert re.fullmatch(r"[a-z0-9]{8}", first) and (tmp_path / "run" / "wandb_id").read_text() == first + "\n"
    assert wandb_run_id(tmp_path / "run", resume=True) == first
    second = wandb_run_id(tmp_path / "run", resume=False)  # a new run in the same dir (--overwrite): a new id
    assert second != first and (tmp_path / "run" / "wandb_id").read_text() == second + "\n"
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep")
    monkeypatch.setenv("WANDB_RUN_ID", "agent123")
    assert wandb_run_id(tmp_path / "trial", resume=False) == "agent123"  # the sweep agent's choice


def test_run_dir_states_and_clearing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert run_dir_state(run) is None
    run.mkdir()
    (run / "mine.txt").write_text("kept")
    assert run_dir_state(run) is None  # a folder without a run's files holds no run
    (run / "metrics.csv").write_text("step\n")
    assert run_dir_state(run) == "stale"
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert run_dir_state(run) == "unfinished"
    (run / "summary.json").write_text("{}")
    assert run_dir_state(run) == "finished"
    clear_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["mine.txt"]  # only the run's own files go
    assert "summary.json" in RUN_FILES and "checkpoints" in RUN_FILES


def test_clients_csv_round_trips_with_empty_cells_for_missing_figures(tmp_path: Path) -> None:
    rows = [{"client": 0, "samples": 5, "accuracy": 0.8, "loss": 0.25},
            {"client": 1, "samples": 0, "accuracy": float("nan"), "loss": float("nan")}]  # fmt: skip
    write_clients_csv(tmp_path / "clients.csv", rows)
    assert (tmp_path / "clients.csv").read_text().splitlines() == ["client,samples,accuracy,loss", "0,5,0.8,0.25",
                                                                   "1,0,,"]  # fmt: skip
    assert read_clients(tmp_path / "clients.csv") == [rows[0], {"client": 1.0, "samples": 0.0}]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_only_the_launching_process_writes_the_id(tmp_path: Path, monkeypatch, rank: str) -> None:
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    monkeypatch.setenv("NODE_RANK", rank)
    wandb_run_id(tmp_path / "run", resume=False)
    assert (tmp_path / "run" / "wandb_id").is_file() == (rank == "0")
