"""Spec 001 / 003 methods (moment descent, power-init low-rank MF) under 2-process CPU DDP equal 1 process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_mixed_regression import SMALL_PROBS, SMALL_SIZES

ROOT = Path(__file__).resolve().parents[1]

MIXED = [
    "--config",
    "configs/mixed_regression/c1.yaml",
    "--config",
    "configs/mixed_regression/fedmd.yaml",
    "--data.init_args.sizes",
    str(SMALL_SIZES),
    "--data.init_args.probs",
    str(SMALL_PROBS),
    "--data.init_args.dim",
    "6",
    "--model.network.init_args.dim",
    "6",
    "--model.network.init_args.num_clusters",
    "2",
    "--model.algorithm.init_args.num_anchors",
    "3",
    "--model.algorithm.init_args.phase1_iters",
    "2",
    "--trainer.max_steps",
    "12",
]
LOWRANK = [
    "--config",
    "configs/lowrank_mf/synthetic.yaml",
    "--data.init_args.num_clients",
    "4",
    "--data.init_args.rows_per_client",
    "30",
    "--data.init_args.dim",
    "12",
    "--data.init_args.rank",
    "3",
    "--model.network.init_args.dim",
    "12",
    "--model.network.init_args.rank",
    "3",
    "--model.network.init_args.max_rows",
    "30",
    "--trainer.max_steps",
    "8",
]


def final_state(args: list[str], devices: int, run_dir: Path) -> dict[str, torch.Tensor]:
    strategy = ["--trainer.strategy", "ddp"] if devices > 1 else []
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "--trainer.accelerator", "cpu"]
    cmd += [
        "--trainer.devices",
        str(devices),
        *strategy,
        "--run_dir",
        str(run_dir),
        "--trainer.enable_progress_bar",
        "false",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")["state_dict"]


@pytest.mark.parametrize("name,args", [("mixed_regression", MIXED), ("lowrank_mf", LOWRANK)])
def test_two_processes_match_one(name, args, tmp_path):
    one, two = final_state(args, 1, tmp_path / "one"), final_state(args, 2, tmp_path / "two")
    assert one.keys() == two.keys() and any(k.startswith("bank.") for k in one)
    for k in one:
        if one[k].is_floating_point():
            torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6, msg=f"{name}: {k}")
        else:
            assert torch.equal(two[k], one[k]), f"{name}: {k}"
