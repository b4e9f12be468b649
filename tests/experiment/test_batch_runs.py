"""Batched runs in the experiment runner: ``--batch-runs K`` / ``batch_runs: K`` (README "Batched runs").

Runs that share an algorithm class and a network train as one job of the run axis by default; each run's numbers
are those of the run alone, which the end-to-end test checks against the same grid with batching off.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fl_lightning.experiment.__main__ import main
from fl_lightning.experiment.runner import batch_groups
from fl_lightning.experiment.spec import ExperimentError, parse_experiment

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits")


def grid(name: str, **more) -> dict:
    """FedAvg at two client learning rates × 2 seeds, and FedRep × 2 seeds, 2 rounds on digits, W&B off."""
    data = {
        "name": name,
        "configs": [f"{DIGITS}/base.yaml"],
        "axes": {
            "method": {
                "fedavg": f"{DIGITS}/fedavg.yaml",
                "fedavg_lr05": {"config": f"{DIGITS}/fedavg.yaml", "model.lr": 0.05},
                "fedrep": f"{DIGITS}/fedrep.yaml",
            },
            "seed": [0, 1],
        },
        "set": {"trainer.max_steps": 2, "checkpoint_every": 1, "trainer.enable_progress_bar": False},
        "wandb": {"mode": "disabled"},
    }
    data.update(more)
    return data


def config(algorithm: str, network: str = "fl_lightning.models.DigitsMLP", **trainer) -> dict:
    return {
        "model": {"algorithm": {"class_path": algorithm}, "network": {"class_path": network, "init_args": {}}},
        "trainer": trainer,
    }


# ---- which runs share a job ---------------------------------------------------------------------------------------


def test_runs_group_by_algorithm_class_and_network_in_grid_order():
    configs = [
        config("FedAvg"),
        config("FedRep"),
        config("FedAvg"),
        config("FedAvg", network="fl_lightning.models.CifarCNN"),
        config("FedRep"),
        config("FedAvg", devices=2),  # a multi-process trainer trains alone
        None,  # not resolved: alone
    ]
    assert batch_groups(list(range(7)), configs, None) == [[0, 2], [1, 4], [3], [5], [6]]


def test_the_limit_splits_a_group_and_one_turns_batching_off():
    configs = [config("FedAvg") for _ in range(5)]
    assert batch_groups(list(range(5)), configs, 2) == [[0, 1], [2, 3], [4]]
    assert batch_groups(list(range(5)), configs, 1) == [[0], [1], [2], [3], [4]]
    assert batch_groups([1, 3, 4], configs, None) == [[1, 3, 4]]  # only the runs still to do


@pytest.mark.parametrize("value", [0, -2, True, "two", 1.5])
def test_a_bad_batch_runs_value_is_refused_with_one_line(value):
    with pytest.raises(ExperimentError) as err:
        parse_experiment({**grid("x"), "batch_runs": value}, source="exp.yaml")
    message = str(err.value)
    assert "\n" not in message and "batch_runs" in message and repr(value) in message


def test_the_file_key_is_read():
    assert parse_experiment({**grid("x"), "batch_runs": 3}, source="exp.yaml").batch_runs == 3
    assert parse_experiment(grid("x"), source="exp.yaml").batch_runs is None


def test_a_bad_flag_value_is_refused(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(grid("flag")))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--batch-runs", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-runs 0" in err[0]


# ---- the same numbers, batched or not ------------------------------------------------------------------------------


def summaries(root: Path, name: str) -> dict[str, dict]:
    return {
        str(p.parent.relative_to(root / name)): json.loads(p.read_text())
        for p in sorted((root / name).glob("*/*/summary.json"))
    }


@pytest.mark.slow
def test_batched_by_default_with_the_numbers_of_each_run_alone(tmp_path, capsys):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(grid("same")))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "batched")]) == 0
    err = capsys.readouterr().err
    batches = [ln for ln in err.splitlines() if ln.startswith("[batch]")]
    # FedAvg's four runs (two seeds × two learning rates) share one job, FedRep's two seeds another
    assert len(batches) == 2 and "(4 runs)" in batches[0] and "(2 runs)" in batches[1]

    assert main(["run", str(path), "--runs-dir", str(tmp_path / "alone"), "--batch-runs", "1"]) == 0
    assert "[batch]" not in capsys.readouterr().err

    key = grid("same", batch_runs=1)  # the file's key does the same, on the smallest group that would batch
    key["axes"]["method"] = {"fedrep": f"{DIGITS}/fedrep.yaml"}  # (FedRep's 2 seeds: 2 runs, not all 6 again)
    path.write_text(yaml.safe_dump(key))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "key")]) == 0
    assert "[batch]" not in capsys.readouterr().err

    batched, alone = summaries(tmp_path / "batched", "same"), summaries(tmp_path / "alone", "same")
    assert sorted(batched) == sorted(alone) and len(batched) == 6
    for run, mine in batched.items():
        for key in ("final", "last10", "best", "upload_bytes"):
            assert math.isfinite(mine[key]) and mine[key] == pytest.approx(alone[run][key], abs=1e-5), (run, key)
    # the two learning rates are different runs with different numbers (not one run reported twice)
    assert batched["fedavg/s0"]["final"] != batched["fedavg_lr05/s0"]["final"] or (
        batched["fedavg/s0"]["last10"] != batched["fedavg_lr05/s0"]["last10"]
    )


@pytest.mark.slow
def test_worker_jobs_run_a_batch_as_one_process(worker_grid):
    """FedRep × 2 seeds with ``--jobs 2`` (tests/experiment/conftest.py; test_runner.py reads the same run)."""
    folder, code, _, err = worker_grid
    assert code == 0
    assert "(2 runs)" in err
    batch = json.loads((folder / "runs" / "workers" / "batches" / "fedrep-s0.json").read_text())
    assert [Path(r["log"]).parent.name for r in batch] == ["s0", "s1"]
    assert len(summaries(folder / "runs", "workers")) == 2


@pytest.mark.slow
def test_ctrl_c_stops_a_batch_and_the_same_command_resumes_each_run(tmp_path, monkeypatch):
    """SIGINT while a batched job trains: exit 130, every run keeps its checkpoint; the same command resumes both
    runs (``--ckpt_path last``) and finishes them."""
    data = grid("stop")
    data["axes"]["method"] = {"fedrep": f"{DIGITS}/fedrep.yaml"}
    data["set"]["trainer.max_steps"] = 20  # stopped after the first round: 19 rounds of margin
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "fl_lightning.experiment", "run", str(path), "--runs-dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    dirs = [tmp_path / "runs" / "stop" / "fedrep" / s for s in ("s0", "s1")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not all(any((d / "checkpoints").glob("round*.ckpt")) for d in dirs):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "run the same command again" in err and "[batch]" in err
    assert not any((d / "summary.json").exists() for d in dirs)

    # the same command again, in this process (the interrupted one had to be another process, to send it SIGINT)
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    for d in dirs:
        log = (d / "train.log").read_text()
        assert log.count("====") == 2 and "--ckpt_path last" in log.split("====")[-1]  # resumed
        assert json.loads((d / "summary.json").read_text())["rounds"] == 20
