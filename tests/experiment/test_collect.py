"""``fl_lightning/experiment/collect.py``: finished runs read from run dirs written here: the curves of a Lightning
``metrics.csv``, ``clients.csv``, the runner's ``run.json`` or a plain ``train.py`` run's summary and config, and the
search for run dirs below folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_lightning.errors import ConfigError
from fl_lightning.experiment.collect import RunResult, find_run_dirs, from_run_dirs, load_run_dir, read_curves


def write_run(folder: Path, summary: dict, run: dict | None = None, seed: int | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.csv").write_text(
        "epoch,step,train/loss,val/acc_mean,lr-SGD\n0,0,2.0,,0.1\n0,1,1.5,,0.1\n0,1,,0.5,\n0,2,1.2,0.6,\n,,,,\n"
    )
    (folder / "clients.csv").write_text("client,samples,accuracy,loss\n0,10,0.5,1.0\n1,0,,\n")
    if run is not None:
        (folder / "run.json").write_text(json.dumps(run))
    if seed is not None:
        (folder / "config.yaml").write_text(f"seed_everything: {seed}\nmodel:\n  lr: 0.1\n")
    return folder


def test_curves_keep_the_last_value_of_each_step_of_the_slash_columns(tmp_path: Path) -> None:
    run = write_run(tmp_path / "r", {"final": 0.6})
    assert read_curves(run / "metrics.csv") == {"train/loss": [(0, 2.0), (1, 1.5), (2, 1.2)],
                                                "val/acc_mean": [(1, 0.5), (2, 0.6)]}  # fmt: skip
    assert read_curves(tmp_path / "missing.csv") == {}


def test_a_runner_run_is_named_by_its_run_json(tmp_path: Path) -> None:
    meta = {"experiment": "table1", "axes": {"method": "FedRep", "lr": 0.01}, "seed": 3}
    result = load_run_dir(write_run(tmp_path / "x" / "fedrep-s3", {"final": 0.6, "metric": "acc"}, run=meta))
    assert (result.experiment, result.axes, result.seed) == ("table1", {"method": "FedRep", "lr": "0.01",
                                                                        "seed": "s3"}, 3)  # fmt: skip
    assert result.clients == [{"client": 0.0, "samples": 10.0, "accuracy": 0.5, "loss": 1.0},
                              {"client": 1.0, "samples": 0.0}]  # fmt: skip
    assert result.key(["experiment", "method", "seed"]) == ("table1", "FedRep", "3")
    assert result.label("absent") == "-" and result.metric == "acc"


def test_a_plain_train_py_run_is_named_by_its_algorithm_and_config_seed(tmp_path: Path) -> None:
    result = load_run_dir(write_run(tmp_path / "runs" / "mine", {"algorithm": "FedAvg", "metric": "mse"}, seed=7))
    assert (result.experiment, result.axes, result.seed) == ("runs", {"method": "FedAvg", "seed": "s7"}, 7)
    assert result.metric == "mse" and result.source == str(tmp_path / "runs" / "mine")
    bare = load_run_dir(write_run(tmp_path / "runs" / "bare", {}))
    assert bare.axes == {"method": "bare"} and bare.seed is None
    assert RunResult("e", {}, None, {}).label("seed") == "-"


def test_run_dirs_are_found_below_folders_once_each_and_missing_paths_refused(tmp_path: Path) -> None:
    a = write_run(tmp_path / "exp" / "a", {"final": 0.1})
    b = write_run(tmp_path / "exp" / "b", {"final": 0.2})
    (tmp_path / "exp" / "b" / "wandb" / "run-1").mkdir(parents=True)
    (tmp_path / "exp" / "b" / "wandb" / "run-1" / "summary.json").write_text("{}")  # W&B's files are no run dir
    assert find_run_dirs([tmp_path / "exp", a]) == [a, b]
    assert [r.summary["final"] for r in from_run_dirs([tmp_path / "exp"])] == [0.1, 0.2]
    with pytest.raises(ConfigError, match="does not exist"):
        find_run_dirs([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no finished run below it"):
        find_run_dirs([tmp_path / "empty"])
