"""N processes give the result of 1 process: 2-rank CPU DDP (gloo) against a single process, with both executors,
unequal clients, a conv net with crop+flip, SCAFFOLD and Ditto (issue 16); and nothing is sent that need not be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_finite

from fl_lightning.engine.aggregation import assign_clients

HERE = Path(__file__).resolve().parent


def run(devices: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "ddp_script.py"), str(devices), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return run(1, tmp / "one.pt"), run(2, tmp / "two.pt")


@pytest.mark.slow  # DDP in subprocesses: out of mutmut's per-function test selection
def test_two_cpu_processes_match_one(runs):
    one, two = runs
    expected = {"fedavg", "fedrep", "scaffold_vectorized", "ditto_cnn_augment_vmap", "fedbn", "fedala", "fedrod"}
    assert set(one) == set(two) and expected <= set(one)
    for name in one:
        assert one[name]["world"] == 1 and two[name]["world"] == 2
        assert len(one[name]["history"]) == len(two[name]["history"]) == 3
        for a, b in zip(one[name]["history"], two[name]["history"]):
            assert a.keys() == b.keys()
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-6, (name, k, a[k], b[k])
        for n, p in one[name]["params"].items():
            assert_close_finite(two[name]["params"][n], p, rtol=0, atol=1e-6, msg=f"{name} {n}")
        for n, rows in one[name]["bank"].items():  # every client's personal state, on rank 0
            assert_close_finite(two[name]["bank"][n], rows, rtol=0, atol=1e-6, msg=f"{name} bank {n}")


@pytest.mark.slow  # DDP in subprocesses: out of mutmut's per-function test selection
def test_ranks_send_no_client_bank_and_only_their_own_clients_rows(runs):
    _, two = runs
    for name, r in two.items():
        assert r["broadcast"] > 0  # DDP did broadcast (the initial sync of the model)
        assert not r["bank_broadcast"], name  # but never the client bank
        # the sum-all-reduce carries the uploads' deltas and the round's counts only, never state rows
        rounds = [n for n in r["reduced"] if n > 1]  # Lightning's own reductions are single numbers
        assert rounds == [r["upload_numel"] + 8] * 3, (name, r["reduced"])
        if r["bank"]:  # state rows: each rank sends at most its own clients' rows (5 per round over 2 ranks)
            assert r["gathered"] and all(shape[0] <= 3 for shape in r["gathered"]), (name, r["gathered"])
        else:
            assert r["gathered"] == []


def test_clients_are_split_over_ranks_by_samples_the_same_way_everywhere():
    sizes = [500, 20, 30, 480, 10, 40]
    layout = assign_clients(sizes, 2)
    assert sorted(j for part in layout for j in part) == list(range(6))  # every client exactly once
    loads = [sum(sizes[j] for j in part) for part in layout]
    assert abs(loads[0] - loads[1]) <= max(sizes[j] for j in range(6) if j not in (0, 3))  # 540 vs 540
    assert loads == [540, 540] and layout == assign_clients(list(sizes), 2)  # a pure function of the sizes
    assert assign_clients([7] * 5, 2) == [[0, 2, 4], [1, 3]]  # equal sizes: round robin
    assert assign_clients([3, 1], 4) == [[0], [1], [], []]  # more ranks than clients
