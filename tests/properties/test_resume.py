"""Exact resume: a run restarted from a checkpoint (also after SIGKILL) gives the uninterrupted run's result,
server state included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from fl_lightning.algorithms import FedRep
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.cli import train_config
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.round_references import DIGITS
from tests.helpers.training import fit, make_trainer, train_here


# ---- server state in checkpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedproto", "feddyn"])
def test_resume_restores_the_server_state(method, tmp_path):
    """FedProto's global prototypes and FedDyn's h are module buffers: stopping after round 3 and resuming gives
    the uninterrupted run's result."""
    configs = [*DIGITS, f"configs/digits/{method}.yaml"]
    short = ["--model.eval_every", "100", "--model.eval_last", "1"]
    straight = train_config(configs, [*short, "--trainer.max_steps", "6"], run_dir=tmp_path / "a")
    train_config(configs, [*short, "--trainer.max_steps", "3"], run_dir=tmp_path / "b")
    resumed = train_config(configs, [*short, "--trainer.max_steps", "6", "--ckpt_path", "last"], run_dir=tmp_path / "b")
    assert resumed["rounds"] == straight["rounds"] == 6 and resumed["final"] == straight["final"]


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(FedRep(2, 1), DigitsMLP(), eval_every=1, eval_last=3)

    full = fit(module(), digits(), rounds=6)
    assert len(full.history) == 6

    ckpt = RoundCheckpoint(
        dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    first = module()
    trainer = make_trainer(6, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(first, datamodule=digits())
    path = tmp_path / "r3.ckpt"
    assert path.exists()

    resumed = module()
    L.seed_everything(123, verbose=False)  # a different process RNG state must not matter
    make_trainer(6, enable_checkpointing=False).fit(resumed, datamodule=digits(), ckpt_path=str(path))
    assert resumed.history == full.history
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n
    for n in full.bank.names:
        assert torch.equal(resumed.bank.row(n), full.bank.row(n))


ROOT = Path(__file__).resolve().parents[2]


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


def train(run_dir: Path, *extra: str) -> int:
    """``train.py ARGS`` in this process (the victim below is a real process, killed)."""
    return train_here([*ARGS, "--run_dir", str(run_dir), *extra])


@pytest.mark.slow
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

    assert train(victim_dir, "--ckpt_path", "last") == 0  # resumed
    assert train(tmp_path / "full") == 0
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((victim_dir / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"]) == (b["final"], b["last10"], b["rounds"])
    metrics = (tmp_path / "full" / "metrics.csv").read_text().splitlines()
    assert len(metrics) > 10
