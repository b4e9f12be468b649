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


def test_runs_group_by_their_identity_in_grid_order():
    configs = [
        config("FedAvg"),
        config("FedRep"),
        config("FedAvg"),
        config("FedAvg", network="fl_lightning.models.CifarCNN"),
        config("FedRep"),
        config("FedAvg", devices=2),  # a multi-process trainer trains alone
        None,  # not resolved: alone
        {**config("FedAvg"), "seed_everything": 3},  # another seed: the same job
        {**config("FedAvg"), "data": {"init_args": {"val_fraction": 0.1}}},  # any other key: a job of its own
    ]
    assert batch_groups(list(range(9)), configs, None) == [[0, 2, 7], [1, 4], [3], [5], [6], [8]]


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


#: labels one key apart from FedAvg's (issue 40: each of these once got another label's numbers when batched)
ONE_KEY_APART = {
    "fedavg_drop_last": {"config": f"{DIGITS}/fedavg.yaml", "model.drop_last": True},
    "fedavg_loop": {"config": f"{DIGITS}/fedavg.yaml", "model.executor": "sequential"},
    "fedavg_uniform": {"config": f"{DIGITS}/fedavg.yaml", "model.aggregation": "uniform"},
    "fedavg_val": {"config": f"{DIGITS}/fedavg.yaml", "data.val_fraction": 0.2},
    "fedavg_e2": {"config": f"{DIGITS}/fedavg.yaml", "model.algorithm.init_args.local_epochs": 2},
}


def results_by_label(root: Path, name: str) -> dict[tuple, float]:
    """The experiment's ``results.json`` (what its table prints) as (method, metric, setting, seed) → value, without
    the wall time."""
    records = json.loads((root / name / "results.json").read_text())
    return {(r["method"], r["metric"], r.get("setting", ""), r.get("seed")): r["value"] for r in records
            if r["metric"] != "wall_s"}  # fmt: skip


@pytest.mark.slow
def test_batched_by_default_with_the_numbers_of_each_run_alone(tmp_path, capsys):
    """Labels that differ from FedAvg in one key only (client learning rate, ``drop_last``, the executor, the
    aggregation, the validation split, an algorithm argument) and FedRep, 2 seeds each: batched by default, each
    label's seeds are one job and every run's numbers (its summary, the printed table) equal ``--batch-runs 1``."""
    data = grid("same")
    data["axes"]["method"].update(ONE_KEY_APART)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "batched")]) == 0
    err = capsys.readouterr().err
    batches = [ln for ln in err.splitlines() if ln.startswith("[batch]")]
    # each label's two seeds share a job, and no two labels do (issue 40)
    assert len(batches) == 3 + len(ONE_KEY_APART) and all("(2 runs)" in b for b in batches)

    assert main(["run", str(path), "--runs-dir", str(tmp_path / "alone"), "--batch-runs", "1"]) == 0
    assert "[batch]" not in capsys.readouterr().err

    key = grid("same", batch_runs=1)  # the file's key does the same, on the smallest group that would batch
    key["axes"]["method"] = {"fedrep": f"{DIGITS}/fedrep.yaml"}  # (FedRep's 2 seeds: 2 runs, not all 6 again)
    path.write_text(yaml.safe_dump(key))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "key")]) == 0
    assert "[batch]" not in capsys.readouterr().err

    batched, alone = summaries(tmp_path / "batched", "same"), summaries(tmp_path / "alone", "same")
    assert sorted(batched) == sorted(alone) and len(batched) == 2 * (3 + len(ONE_KEY_APART))
    for run, mine in batched.items():
        for key in ("final", "last10", "best", "upload_bytes"):
            assert math.isfinite(mine[key]) and mine[key] == alone[run][key], (run, key)
        label = run.split("/")[0]
        assert len(mine["ran"]["batch"]["runs"]) == 2 and all(label in r for r in mine["ran"]["batch"]["runs"])
        assert alone[run]["ran"]["batch"] is None
    assert batched["fedavg_loop/s0"]["ran"]["executor"] == "sequential" != batched["fedavg/s0"]["ran"]["executor"]
    assert results_by_label(tmp_path / "batched", "same") == results_by_label(tmp_path / "alone", "same")
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


@pytest.mark.slow
@pytest.mark.parametrize("batch_runs", [None, 1])
def test_every_train_log_says_its_path_and_warnings_batched_or_alone(tmp_path, capsys, batch_runs):
    """FedBN on a BatchNorm1d network, 3 seeds, on the stacked path (``auto``) and on the loop: batched (one job of
    3 per label) or one run at a time in one process, every run's ``train.log`` holds its own executor line and the
    BatchNorm1d skip warning (batches of 8: some client ends on 1 sample), and no logging error (issue 40)."""
    data = grid("logs", **({"batch_runs": batch_runs} if batch_runs else {}))
    data["axes"] = {
        "method": {"fedbn": f"{DIGITS}/fedbn.yaml",
                   "fedbn_loop": {"config": f"{DIGITS}/fedbn.yaml", "model.executor": "sequential"}},
        "seed": [0, 1, 2],
    }  # fmt: skip
    data["set"]["model.batch_size"] = 8
    data["set"]["model.network"] = {"class_path": "tests.engine.test_drop_last_and_summary.BNMLP"}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    err = capsys.readouterr().err
    assert sum(ln.startswith("[batch]") for ln in err.splitlines()) == (2 if batch_runs is None else 0)
    logs = sorted((tmp_path / "runs" / "logs").glob("*/*/train.log"))
    assert len(logs) == 6
    for log in logs:
        text = log.read_text()
        loop = "executor: sequential (eval: loop) because model.executor: sequential"
        path_line = loop if "fedbn_loop" in str(log) else ") because FedBN is vectorizable"
        assert text.count(path_line) == 1, (log, text[-2000:])
        assert text.count("a client's last minibatch of 1 sample is skipped") == 1, log
        assert "Logging error" not in text and "I/O operation on closed file" not in text, log
        assert ("run axis: " in text) == (batch_runs is None), log


def test_report_metrics_leave_the_experiment_its_name():
    """A ``report.metrics`` list is checked name by name without renaming the experiment (after a merge, the last
    metric checked became the experiment's name and its run dirs' folder)."""
    data = {**grid("kept"), "report": {"metrics": ["last10", "final_worst10"]}}
    assert parse_experiment(data, source="exp.yaml").name == "kept"
