"""``fl_lightning/config_checks.py``: the range rules read from an argument's name and declared default, where a
value was set (command line or config file and line), and why a run dir cannot hold a run, on configs and folders
written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_lightning.config_checks import check_ranges, init_default, locate, run_dir_problem, where
from fl_lightning.errors import ConfigError


def _model(**algorithm_args) -> dict:
    return {"algorithm": {"class_path": "fl_lightning.algorithms.FedRep", "init_args": algorithm_args}}


def test_learning_rates_must_be_positive_and_counts_at_least_one() -> None:
    check_ranges({"model": _model(head_epochs=1, body_epochs=1)}, [])  # in range: nothing raised
    with pytest.raises(ConfigError, match=r"^model.lr must be positive and finite \(> 0, a learning rate\), got 0"):
        check_ranges({"model": {"lr": 0}}, [])
    with pytest.raises(ConfigError, match=r"^model.algorithm.head_epochs must be positive \(an integer ≥ 1\), got 0"):
        check_ranges({"model": _model(head_epochs=0)}, [])
    with pytest.raises(ConfigError, match=r"head_epochs must be positive \(an integer ≥ 1\), got 1.5"):
        check_ranges({"model": _model(head_epochs=1.5)}, [])
    with pytest.raises(ConfigError, match=r"^trainer.max_steps must be positive"):
        check_ranges({"trainer": {"max_steps": 0}}, [])
    with pytest.raises(ConfigError, match=r"^wandb.mode must be one of auto, online, offline, disabled, got 'on'"):
        check_ranges({"wandb": {"mode": "on"}}, [])
    with pytest.raises(ConfigError, match=r"^model.momentum must be ≥ 0, got -0.5"):
        check_ranges({"model": {"momentum": -0.5}}, [])


def test_a_count_whose_default_is_zero_may_be_zero() -> None:
    class Algo:
        def __init__(self, warmup_rounds: int = 0, local_epochs: int = 1) -> None: ...

    assert init_default(Algo, "warmup_rounds") == 0 and init_default(Algo, "local_epochs") == 1
    power = {"class_path": "fl_lightning.algorithms.FedMD", "init_args": {"power_iters": 0}}
    check_ranges({"model": {"algorithm": power}}, [])  # its declared default is 0: 0 means "off"
    power["init_args"]["power_iters"] = -1
    with pytest.raises(ConfigError, match=r"power_iters must be an integer ≥ 0 \(0: off\), got -1"):
        check_ranges({"model": {"algorithm": power}}, [])
    # FedRep's own arguments have defaults ≥ 1, a class of another project is not checked by name
    check_ranges({"model": {"algorithm": {"class_path": "torch.optim.SGD", "init_args": {"lr": -1}}}}, [])


def test_where_names_the_last_setter_command_line_or_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "a.yaml"
    config.write_text("model:\n  lr: 0.1\n  algorithm:\n    init_args:\n      head_epochs: 0\n")
    assert where("model.lr", ["--config", str(config)]) == f"{config} line 2"
    assert where("model.algorithm.head_epochs", [f"--config={config}"]) == f"{config} line 5"
    assert where("model.lr", ["--config", str(config), "--model.lr", "0"]) == "--model.lr"
    assert where("model.lr", ["--model.lr=0", "--config", str(config)]) == f"{config} line 2"  # later wins
    assert where("model.momentum", ["--config", str(config)]) == ""
    with pytest.raises(ConfigError, match=rf"head_epochs must be positive .*, got 0 \({config} line 5\); fix:"):
        check_ranges({"model": _model(head_epochs=0)}, ["--config", str(config)])
    located = locate("model.lr: value 'x' given", ["--config", str(config)])
    assert located == f"model.lr ({config} line 2): value 'x' given"
    assert locate("model.lr: bad", ["--model.lr", "x"]) == "model.lr: bad"  # typed on the command line: as it is
    assert locate("no key here", []) == "no key here"


def test_run_dir_problems(tmp_path: Path) -> None:
    assert run_dir_problem(tmp_path / "new" / "run") is None
    assert not (tmp_path / "new").exists()  # the probe leaves no folder behind
    (tmp_path / "file").write_text("")
    assert run_dir_problem(tmp_path / "file") == f"--run_dir {tmp_path / 'file'} is a file, not a folder"
    assert run_dir_problem(tmp_path / "file" / "run").endswith("which is a file, not a folder")
    experiment = tmp_path / "experiment"
    (experiment / "a" / "s0").mkdir(parents=True)
    (experiment / "a" / "s0" / "run.json").write_text("{}")
    assert "holds an experiment's runs in its subfolders" in run_dir_problem(experiment)
