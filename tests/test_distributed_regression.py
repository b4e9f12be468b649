"""Spec 001 / 003 / 004 methods (moment descent, power-init low-rank MF, float64 population FedAvg) under 2-process
CPU DDP equal 1 process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_finite
from test_lowrank_mf import SMALL_SYNTHETIC_ARGS
from test_mixed_regression import SMALL_FEDMD_ARGS

pytestmark = pytest.mark.slow  # train.py in subprocesses: out of mutmut's per-function test selection

ROOT = Path(__file__).resolve().parents[1]

MIXED = [
    "--config",
    "configs/mixed_regression/c1.yaml",
    "--config",
    "configs/mixed_regression/fedmd.yaml",
    *SMALL_FEDMD_ARGS,
    "--trainer.max_steps",
    "12",
]
LOWRANK = ["--config", "configs/lowrank_mf/synthetic.yaml", *SMALL_SYNTHETIC_ARGS, "--trainer.max_steps", "8"]
# spec 004 in float64 (trainer.precision 64-true in linear_base.yaml): the all-reduce must keep float64
LINEAR = [
    *["--config", "configs/representation/linear_base.yaml", "--config", "configs/representation/linear_fedavg.yaml"],
    *["--data.init_args.num_clients", "6", "--data.init_args.new_clients", "2", "--trainer.max_steps", "30"],
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


@pytest.mark.parametrize(
    "name,args", [("mixed_regression", MIXED), ("lowrank_mf", LOWRANK), ("linear_population_float64", LINEAR)]
)
def test_two_processes_match_one(name, args, tmp_path):
    one, two = final_state(args, 1, tmp_path / "one"), final_state(args, 2, tmp_path / "two")
    assert one.keys() == two.keys()
    assert any(k.startswith("bank.") for k in one) or name == "linear_population_float64"  # FedAvg: no client state
    if name == "linear_population_float64":
        assert one["net.body.weight"].dtype == two["net.body.weight"].dtype == torch.float64
    for k in one:
        if one[k].is_floating_point():
            atol = 1e-12 if one[k].dtype == torch.float64 and name == "linear_population_float64" else 1e-6
            assert_close_finite(two[k], one[k], rtol=0, atol=atol, msg=f"{name}: {k}")
        else:
            assert torch.equal(two[k], one[k]), f"{name}: {k}"
