"""``fl_lightning/experiment/validation.py``: every experiment file of the repository passes train.py's parser, and
train.py's parser takes the arguments a W&B sweep agent sends."""

from __future__ import annotations

import os

import yaml

from fl_lightning.experiment.spec import load_experiment
from tests.helpers.experiment_files import ROOT


def test_the_repository_experiment_files_expand_and_parse():
    """Every file in configs/experiments/ loads; the digits ones pass train.py's parser (data on disk is not
    needed to parse, so the real-data columns are parsed too)."""
    from fl_lightning.experiment.validation import validate_runs

    files = sorted((ROOT / "configs" / "experiments").glob("*.yaml"))
    names = {f.stem for f in files}
    assert {"table1_digits", "quick_digits", "perfedsi_digits", "table1_cifar10_100x2"} <= names
    for f in files:
        experiment = load_experiment(f)
        runs = experiment.runs()
        seeds = [p.value for p in experiment.axes["seed"]]
        assert len(seeds) >= (2 if f.stem == "quick_digits" else 3), f
        resolved = validate_runs(experiment, runs)
        assert len(resolved) == len(runs) == len({r.wandb_name for r in runs})
    table1 = load_experiment(ROOT / "configs" / "experiments" / "table1_digits.yaml")
    assert len(table1.axes["method"]) == 15 and len(table1.runs()) == 45


def agent_command(sweep: dict, values: dict) -> list[str]:
    """The command line ``wandb agent`` runs for one trial, built with wandb's own helpers as the agent does."""
    from wandb.sdk.launch.sweeps import utils

    sweep_vars = utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})
    sweep_vars.update(interpreter=["python"], program=[sweep["program"]], env=["/usr/bin/env"])
    command = []
    for c in utils.create_sweep_command(list(sweep["command"])):
        c = str(c)
        command += sweep_vars.get(c[2:-1]) or [] if c.startswith("${") and c.endswith("}") else [c]
    return command


def test_train_py_accepts_the_arguments_a_sweep_agent_sends():
    from fl_lightning.experiment.validation import parse_train_args

    for path in sorted((ROOT / "configs" / "sweeps").glob("*.yaml")):
        sweep = yaml.safe_load(path.read_text())
        assert sweep["program"] == "train.py" and "${args}" in sweep["command"]
        for pick in (0, -1):
            values = {k: (p["values"][pick] if "values" in p else p["min" if pick == 0 else "max"])
                      for k, p in sweep["parameters"].items()}  # fmt: skip
            command = agent_command(sweep, values)
            assert command[:3] == ["/usr/bin/env", "python", "train.py"]
            assert [a for a in command if a.startswith("--") and "=" in a][-len(values):] == [
                f"--{k}={v}" for k, v in values.items()]  # fmt: skip
            cwd = os.getcwd()
            os.chdir(ROOT)  # the agent runs from the repository root
            try:
                config = parse_train_args(command[3:])
            finally:
                os.chdir(cwd)
            for key, value in values.items():
                node = config
                for part in key.split("."):
                    node = node[part]
                assert node == value, (path.name, key)
