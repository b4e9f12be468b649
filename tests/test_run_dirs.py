"""One run per run dir (refuse, --overwrite, resume into the same W&B run and metrics.csv), the per-client
spread of every evaluation, and what a run leaves in W&B and in its run dir at the end."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_lightning.cli import main as train_main
from fl_lightning.engine.evaluation import ClientEvaluation
from fl_lightning.experiment.wandb_files import offline_runs

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.enable_progress_bar", "false"]


def train(run_dir: Path, *args: str) -> int:
    """``train.py`` in this process (WANDB_MODE from the environment: disabled unless a test sets it)."""
    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return train_main([*QUICK, "--run_dir", str(run_dir), *args])
    finally:
        sys.argv = argv


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def per_step(path: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in csv_rows(path) if r.get(key)}


# ---- the spread over clients ------------------------------------------------------------------------------------


def test_client_spread_matches_an_independent_computation():
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.2, 1.0, size=37)
    loss = rng.uniform(0.1, 3.0, size=37)
    samples = rng.integers(1, 50, size=37).astype(float)
    samples[[3, 11, 20]] = 0  # clients without test data do not count
    result = ClientEvaluation(5, torch.tensor(acc), torch.tensor(loss), 0.0, 0.0, 0.0, torch.tensor(samples))
    have = samples > 0
    a, l_ = acc[have], loss[have]
    k = math.ceil(0.1 * have.sum())  # 34 clients with data -> the worst 4
    assert k == 4
    spread = result.spread()
    assert spread["acc_std"] == pytest.approx(np.sqrt(np.mean((a - a.mean()) ** 2)), abs=1e-12)
    assert spread["acc_worst10"] == pytest.approx(np.sort(a)[:k].mean(), abs=1e-12)
    assert spread["acc_min"] == pytest.approx(a.min(), abs=1e-12)
    reg = result.spread(regression=True)
    assert reg["mse_std"] == pytest.approx(l_.std(), abs=1e-12)
    assert reg["mse_worst10"] == pytest.approx(np.sort(l_)[-k:].mean(), abs=1e-12)
    assert reg["mse_max"] == pytest.approx(l_.max(), abs=1e-12)
    few = ClientEvaluation(0, torch.tensor([0.5, 0.9]), torch.zeros(2), 0.0, 0.0, 0.0, torch.tensor([3.0, 4.0]))
    assert few.spread()["acc_worst10"] == 0.5  # at least one client


def test_logged_spread_and_final_figures_match_the_per_client_file(tmp_path):
    """The last evaluation's val/acc_std, val/acc_worst10, val/acc_min in metrics.csv and the summary's final_*
    equal numpy over clients.csv (the final per-client accuracies)."""
    assert train(tmp_path, "--trainer.max_steps", "3") == 0
    clients = csv_rows(tmp_path / "clients.csv")
    assert [int(c["client"]) for c in clients] == list(range(20))
    acc = np.array([float(c["accuracy"]) for c in clients if int(c["samples"]) > 0])
    worst = np.sort(acc)[: math.ceil(0.1 * len(acc))].mean()
    last = max(per_step(tmp_path / "metrics.csv", "val/acc_mean"))
    logged = {k: per_step(tmp_path / "metrics.csv", f"val/{k}")[last] for k in ("acc_mean", "acc_std", "acc_worst10",
                                                                               "acc_min")}  # fmt: skip
    assert logged["acc_mean"] == pytest.approx(acc.mean(), abs=1e-6)  # float32 in the CSV
    assert logged["acc_std"] == pytest.approx(acc.std(), abs=1e-6)
    assert logged["acc_worst10"] == pytest.approx(worst, abs=1e-6)
    assert logged["acc_min"] == pytest.approx(acc.min(), abs=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_std"] == pytest.approx(acc.std(), abs=1e-12)
    assert summary["final_worst10"] == pytest.approx(worst, abs=1e-12)
    assert summary["final_min"] == pytest.approx(acc.min(), abs=1e-12)
    history = [h["val/acc_mean"] for h in json.loads((tmp_path / "history.json").read_text())]
    assert summary["best"] == max(history) and summary["rounds"] == 3
    uploads = per_step(tmp_path / "metrics.csv", "comm/upload_bytes")
    assert summary["upload_bytes"] == pytest.approx(sum(uploads.values()))


# ---- one run per run dir -----------------------------------------------------------------------------------------


def test_a_run_dir_holds_one_run(tmp_path, capsys):
    assert train(tmp_path, "--trainer.max_steps", "2") == 0
    summary = (tmp_path / "summary.json").read_text()
    stamp = (tmp_path / "summary.json").stat().st_mtime_ns
    capsys.readouterr()

    assert train(tmp_path, "--trainer.max_steps", "2") == 2  # a second run into the same dir
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ckpt_path last" in err[0] and "--overwrite" in err[0] and str(tmp_path) in err[0]

    assert train(tmp_path, "--trainer.max_steps", "2", "--ckpt_path", "last") == 0  # resuming a finished run
    assert "nothing to resume" in capsys.readouterr().out
    assert train(tmp_path, "--trainer.max_steps", "2", "--trainer.fast_dev_run", "true") == 0
    assert (tmp_path / "summary.json").read_text() == summary  # neither shrinks nor overwrites it
    assert (tmp_path / "summary.json").stat().st_mtime_ns == stamp
    assert len(csv_rows(tmp_path / "metrics.csv")) > 0

    assert train(tmp_path, "--trainer.max_steps", "3", "--overwrite", "true") == 0
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == 3
    assert sorted(per_step(tmp_path / "metrics.csv", "val/acc_mean")) == [0, 1, 2]

    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "round00001.ckpt").write_bytes(b"")  # an unfinished run: a checkpoint to resume
    assert train(other, "--trainer.max_steps", "2") == 2
    assert "holds an unfinished run" in capsys.readouterr().err and "--overwrite true" in err[0]
    (other / "checkpoints" / "round00001.ckpt").unlink()
    (other / "metrics.csv").write_text("step\n0\n")  # a run that stopped before its first checkpoint: reused
    assert train(other, "--trainer.max_steps", "2") == 0
    assert "starting it afresh" in capsys.readouterr().out


@pytest.mark.slow
def test_a_killed_run_resumes_into_one_wandb_run_and_a_complete_metrics_csv(tmp_path):
    rounds = ["--trainer.max_steps", "12", "--checkpoint_every", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # fmt: skip
    victim_dir = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), *QUICK, *rounds, "--run_dir", str(victim_dir)]
    victim = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (victim_dir / "checkpoints" / "round00004.ckpt").exists():
            assert victim.poll() is None, "the run finished before it could be killed"
            assert time.time() < deadline
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
    assert not (victim_dir / "summary.json").exists()
    resumed = subprocess.run([*cmd, "--ckpt_path", "last"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    deadline = time.monotonic() + 60
    while not (runs := offline_runs(victim_dir))[-1].exited and time.monotonic() < deadline:
        time.sleep(0.1)  # W&B's service may still be writing the resumed run's file
    # one W&B run, written by two processes (W&B loses what the killed process had not flushed yet; the
    # resumed process logs every round it recomputes, metrics.csv keeps them all)
    assert len(runs) == 2 and len({r.id for r in runs}) == 1
    assert runs[-1].id == (victim_dir / "wandb_id").read_text().strip() and runs[-1].name == "killed"
    assert [row["trainer/global_step"] for row in runs[-1].history if "val/acc_mean" in row][-1] == 11

    full = tmp_path / "full"
    assert train(full, *rounds) == 0  # the same run, never interrupted (W&B disabled)
    for key in ("val/acc_mean", "val/acc_std", "train/loss"):
        got, want = per_step(victim_dir / "metrics.csv", key), per_step(full / "metrics.csv", key)
        assert sorted(got) == list(range(12)) and got == pytest.approx(want, abs=1e-6), key
    steps = [int(r["step"]) for r in csv_rows(victim_dir / "metrics.csv") if r.get("val/acc_mean")]
    assert steps == list(range(12))  # every round once: the rows logged after the checkpoint were replaced
    a = json.loads((victim_dir / "summary.json").read_text())
    b = json.loads((full / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"], a["upload_bytes"]) == (b["final"], b["last10"], b["rounds"],
                                                                          b["upload_bytes"])  # fmt: skip


# ---- what W&B gets ------------------------------------------------------------------------------------------------


def test_wandb_gets_histograms_the_client_table_and_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train(tmp_path, "--trainer.max_steps", "5", "--wandb.histogram_every", "2") == 0
    capsys.readouterr()
    (run,) = offline_runs(tmp_path, wait_s=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {k[len("summary/"):]: v for k, v in run.summary.items() if k.startswith("summary/")} == summary
    steps = [row["trainer/global_step"] for row in run.history if "val/acc_clients/values" in row]
    assert len(steps) == 3  # evaluations 2 and 4, and the last round
    histogram = next(row for row in run.history if "val/acc_clients/values" in row)
    assert sum(histogram["val/acc_clients/values"]) == 20  # one entry per client with test data
    table = json.loads((run.files[0].parent / "files" / run.summary["clients/final"]["path"]).read_text())
    assert table["columns"] == ["client", "samples", "accuracy", "loss"]
    clients = csv_rows(tmp_path / "clients.csv")
    assert [[int(r[0]), int(r[1]), r[2]] for r in table["data"]] == [
        [int(c["client"]), int(c["samples"]), pytest.approx(float(c["accuracy"]))] for c in clients
    ]
    assert run.summary["val/acc_min"] == pytest.approx(summary["final_min"], abs=1e-6)


def test_a_logger_from_the_config_gets_the_full_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"save_dir": str(tmp_path / "mine"), "project": "mine", "group": "g"}}  # fmt: skip
    assert train(tmp_path / "run", "--trainer.max_steps", "2", "--trainer.logger", json.dumps(logger)) == 0
    capsys.readouterr()
    (run,) = offline_runs(tmp_path / "mine", wait_s=60)
    assert run.project == "mine" and run.group == "g"
    assert run.config["data"]["class_path"] == "datamodules.DigitsDataModule"
    assert run.config["model"]["algorithm"]["class_path"] == "fl_lightning.algorithms.FedRep"
    assert run.config["trainer"]["max_steps"] == 2
