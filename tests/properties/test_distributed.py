"""N processes give the result of 1 process: CPU DDP (gloo) against a single process, with both executors, and the
spec methods under 2-process train.py runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fl_lightning.engine.aggregation import assign_clients
from tests.experiments.test_lowrank_mf import SMALL_SYNTHETIC_ARGS
from tests.experiments.test_mixed_regression import SMALL_FEDMD_ARGS
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import train_here

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def run(devices: int, out: Path, train: Path) -> dict:
    """``ddp_script.py DEVICES OUT TRAIN``: its fits, then the train.py runs of ``train`` (a JSON file), in one launch
    of ``devices`` processes (two interpreter starts for everything)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(HELPERS / "ddp_script.py"), str(devices), str(out), str(train)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def run_here(out: Path) -> dict:
    """``ddp_script.py 1 OUT`` in this process (one process needs no launcher): the script patches DDP's broadcast
    and the conv policy table, both restored afterwards."""
    import fl_lightning.engine.stacked as stacked

    broadcast, conv = torch.distributed._broadcast_coalesced, dict(stacked.CONV_CLIENTS)
    try:
        from tests.helpers import ddp_script

        ddp_script.main(1, str(out))
    finally:
        torch.distributed._broadcast_coalesced = broadcast
        stacked.CONV_CLIENTS.clear()
        stacked.CONV_CLIENTS.update(conv)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[dict, Path]:
    """The one 2-process launch: ddp_script's fits and the spec runs of ``TRAIN_RUNS`` (their run dirs under the
    returned folder)."""
    tmp = tmp_path_factory.mktemp("ddp")
    spec = {name: [*args, "--run_dir", str(tmp / name)] for name, args in TRAIN_RUNS.items()}
    (tmp / "train.json").write_text(json.dumps(spec))
    return run(2, tmp / "two.pt", tmp / "train.json"), tmp


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch):
    return run_here(tmp_path_factory.mktemp("ddp_one") / "one.pt"), launch[0]


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
        # then, once, the summary's collapse check: the predicted- and true-class counts over each rank's clients'
        # test rows (2 × 10 digits classes; evaluation.class_shares), never a client's own row
        assert rounds == [r["upload_numel"] + 8] * 3 + [2 * 10], (name, r["reduced"])
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


ROOT = Path(__file__).resolve().parents[2]


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


TRAIN_RUNS = {"mixed_regression": MIXED, "lowrank_mf": LOWRANK, "linear_population_float64": LINEAR}


def final_state(args: list[str], run_dir: Path) -> dict[str, torch.Tensor]:
    """train.py ARGS on one process, here (``cli.main``, what train.py calls): the last checkpoint's state."""
    args = [*args, "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--run_dir", str(run_dir)]
    with contextlib.chdir(ROOT):
        assert train_here([*args, "--trainer.enable_progress_bar", "false"]) == 0
    return last_state(run_dir)


def last_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")["state_dict"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_RUNS))
def test_two_processes_match_one(name, tmp_path, launch):
    """The 2-process run comes from the module's one launch (ddp_script.py calling cli.main, as train.py does)."""
    one, two = final_state(TRAIN_RUNS[name], tmp_path / "one"), last_state(launch[1] / name)
    trainer = yaml.safe_load((launch[1] / name / "config.yaml").read_text())["trainer"]
    assert str(trainer["devices"]) == "2" and trainer["strategy"] == "ddp"  # the launch's own 2 processes
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
