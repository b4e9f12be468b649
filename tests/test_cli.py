"""train.py end to end: the quickstart, overrides, --print_config, resume with --ckpt_path last, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # train.py in subprocesses: out of mutmut's per-function test selection

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--config", "configs/quickstart.yaml", "--trainer.enable_progress_bar", "false"]


def train(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_quickstart_prints_the_result_table(tmp_path):
    out = train(*QUICK, "--trainer.max_steps", "3", "--run_dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "algorithm" in out.stdout and "FedRep" in out.stdout and "last10" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 3 and 0 <= summary["last10"] <= 1
    assert (tmp_path / "metrics.csv").exists()
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "config.yaml").exists()
    history = json.loads((tmp_path / "history.json").read_text())
    assert [h["round"] for h in history] == [0, 1, 2] and history[-1]["val/acc_mean"] == summary["final"]


def test_print_config_round_trips():
    out = train(*QUICK, "--model.lr", "0.05", "--print_config")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lr: 0.05" in out.stdout and "fl_lightning.algorithms.FedRep" in out.stdout


def test_resume_with_ckpt_path_last_continues_to_the_same_result(tmp_path):
    full = train(*QUICK, "--trainer.max_steps", "6", "--run_dir", str(tmp_path / "full"))
    part = train(*QUICK, "--trainer.max_steps", "3", "--run_dir", str(tmp_path / "part"), "--checkpoint_every", "3")
    assert full.returncode == 0 and part.returncode == 0, part.stderr[-2000:]
    resumed = train(*QUICK, "--trainer.max_steps", "6", "--run_dir", str(tmp_path / "part"), "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"]) == (b["final"], b["last10"], b["rounds"])


BAD_INPUTS = {
    "unknown algorithm": (["--model.algorithm", "fl_lightning.algorithms.FedFoo"], "unknown class"),
    "unknown short algorithm": (["--model.algorithm", "FedFoo"], "unknown class"),
    "unknown dataset": (["--data", "datamodules.ImageNet42"], "unknown class"),
    "too many clients per round": (["--data.init_args.clients_per_round", "21"], "more than data.num_clients"),
    "unfillable shards": (
        ["--data.init_args.num_clients", "200", "--data.init_args.partition.init_args.classes_per_client", "10"],
        "too few to fill",
    ),
    "participation above 1": (["--data.init_args.participation", "1.5"], "participation"),
    "negative lr": (["--model.lr", "-0.1"], "lr must be positive"),
    "personal prefix matches nothing": (["--model.algorithm.init_args.personal", "[classifier.]"], "matches no"),
    "unknown key": (["--model.learning_rate", "0.1"], "learning_rate"),
    "missing resume checkpoint": (["--ckpt_path", "last", "--run_dir", "/nonexistent/run"], "no checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_a_one_line_error(case, monkeypatch, capsys, tmp_path):
    """In this process (``fl_lightning.cli.main``, what train.py calls); the real entry point is checked below. The
    run dir is a fresh one (a finished ``runs/quickstart`` from ``make train`` would be refused first)."""
    from fl_lightning.cli import main

    args, expected = BAD_INPUTS[case]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    code = main([*QUICK, "--trainer.max_steps", "1", "--run_dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]
    assert "Traceback" not in err


def test_train_py_itself_gives_the_one_line_error_and_exit_code_2():
    args, expected = BAD_INPUTS["unknown key"]
    out = train(*QUICK, "--trainer.max_steps", "1", *args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_wandb_offline_run_directory_is_written(tmp_path):
    env_mode = os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "offline"
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), *QUICK, "--trainer.max_steps", "2", "--run_dir", str(tmp_path)],
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.environ["WANDB_MODE"] = env_mode or "disabled"
    assert out.returncode == 0, out.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
