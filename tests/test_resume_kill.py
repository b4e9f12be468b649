"""A run killed with SIGKILL after a checkpoint resumes with --ckpt_path last to the uninterrupted result."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # train.py in subprocesses: out of mutmut's per-function test selection

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--config",
    str(ROOT / "configs/quickstart.yaml"),
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.max_steps",
    "30",
    "--checkpoint_every",
    "5",
    "--model.algorithm.init_args.head_epochs",
    "3",
]
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "--run_dir", str(run_dir), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    victim_dir = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), *ARGS, "--run_dir", str(victim_dir)]
    victim = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (victim_dir / "checkpoints" / "round00010.ckpt").exists():
        assert victim.poll() is None, "the run finished before it could be killed"
        assert time.time() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (victim_dir / "summary.json").exists(), "killed before the end"

    resumed = train(victim_dir, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full = train(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((victim_dir / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"]) == (b["final"], b["last10"], b["rounds"])
    metrics = (tmp_path / "full" / "metrics.csv").read_text().splitlines()
    assert len(metrics) > 10
