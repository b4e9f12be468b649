"""N processes give the result of 1 process: 2-rank CPU DDP (gloo) against a single process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from helpers import assert_close_finite

HERE = Path(__file__).resolve().parent


def run(devices: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "ddp_script.py"), str(devices), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_two_cpu_processes_match_one(tmp_path):
    one, two = run(1, tmp_path / "one.pt"), run(2, tmp_path / "two.pt")
    assert set(one) == set(two) and {"fedavg", "fedrep", "lg_fedavg", "fedbn", "fedala", "fedrod"} <= set(one)
    for name in one:
        assert one[name]["world"] == 1 and two[name]["world"] == 2
        for a, b in zip(one[name]["history"], two[name]["history"]):
            assert a.keys() == b.keys()
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-6, (name, k, a[k], b[k])
        for n, p in one[name]["params"].items():
            assert_close_finite(two[name]["params"][n], p, rtol=0, atol=1e-6, msg=f"{name} {n}")
        for n, rows in one[name]["bank"].items():  # every client's personal state, on rank 0
            assert_close_finite(two[name]["bank"][n], rows, rtol=0, atol=1e-6, msg=f"{name} bank {n}")
