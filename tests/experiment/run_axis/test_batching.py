"""A batched run is the run alone, by construction (issue 40 item 2).

For every leaf key of the resolved configs of representative runs (FedAvg with DP, FedRep with "+FT", Ditto with a
validation split, FedBN on a BatchNorm network with ``drop_last``, MOON; all on the bundled digits), a second run
that differs from it only at that key either lands in another batched job (``runner.batch_groups``, the runner's
own grouping, and ``check_batchable`` refuses the pair) or, batched with it, gives exactly the numbers it gives
alone: ``summary.json`` and ``metrics.csv``, cell for cell. The keys are walked, not listed: a key that the config
gains later is covered without editing this file. Only the keys that say how a run is invoked (``INVOCATION``)
are not varied.
"""

from __future__ import annotations

import copy
import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fl_lightning.cli import train_config
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.run_axis import BatchedRuns, check_batchable, parse_config
from fl_lightning.experiment.run_axis.batching import batch_key
from fl_lightning.experiment.runner import batch_groups
from fl_lightning.identity import RESUME_MAY_CHANGE, flatten, under

ROOT = Path(__file__).resolve().parents[3]
DIGITS = ROOT / "configs" / "digits"
SMALL = [
    "--trainer.max_steps", "2", "--data.init_args.num_clients", "10", "--data.init_args.participation", "0.3",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip


def config_args(*names: str) -> list[str]:
    return [a for name in ("base", *names) for a in ("--config", str(DIGITS / f"{name}.yaml"))]


#: the representative runs of the issue, each small (2 rounds, 3 of 10 clients per round)
REPRESENTATIVE: dict[str, list[str]] = {
    "fedavg_dp": [*config_args("fedavg"), "--config", str(ROOT / "configs/dp/privacy.yaml"), *SMALL],
    "fedrep_ft": [*config_args("fedrep"), *SMALL, "--model.algorithm.init_args.head_epochs", "2",
                  "--model.finetune", '{"epochs": 2}'],
    "ditto_val": [*config_args("ditto"), *SMALL, "--data.init_args.val_fraction", "0.2"],
    "fedbn_drop_last": [*config_args("fedbn"), *SMALL, "--model.drop_last", "true"],
    "moon": [*config_args("moon"), *SMALL],
}  # fmt: skip

#: keys that say how a run is invoked, not what it is: each run of a job has its own run dir and checkpoint to
#: resume, ``config`` lists the files its values came from (the values themselves are walked), ``overwrite`` and
#: ``print_config`` act before a run starts
INVOCATION = ("config", "run_dir", "ckpt_path", "overwrite", "print_config", "__path__")


def leaves(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf of a resolved config with its full path (``init_args`` levels kept: the train.py key)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    else:
        yield path, node


def other_value(value: Any) -> Any:
    """A value other than ``value`` of the same kind (``None``: a number, the most common kind of optional key)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 if value else 0.1
    if isinstance(value, str):
        return value + "_other"
    if isinstance(value, (list, tuple)):
        return [*value, *(value[:1] or ["other"])]
    if isinstance(value, dict):
        return {"other": 1}
    return 1


def set_leaf(config: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def dotted(path: tuple[str, ...]) -> str:
    """The identity's name of a leaf (``init_args`` levels left out, as ``fl_lightning.identity.flatten``)."""
    return ".".join(p for p in path if p != "init_args")


def variants(
    config: dict[str, Any],
) -> tuple[list[tuple[tuple[str, ...], Any]], dict[str, dict[str, Any]]]:
    """(the leaves whose variant may share a batched job with the run, each with its other value; the variant
    config of each leaf, by its identity name, that lands in another job)."""
    together, apart = [], {}
    key = batch_key(config)
    for path, value in leaves(config):
        if dotted(path).split(".")[0] in INVOCATION:
            continue
        variant = set_leaf(config, path, other_value(value))
        if batch_key(variant) == key:
            together.append((path, other_value(value)))
        else:
            apart[dotted(path)] = variant
    return together, apart


@pytest.fixture(scope="module")
def configs() -> dict[str, dict[str, Any]]:
    return {name: parse_config(args) for name, args in REPRESENTATIVE.items()}


@pytest.mark.parametrize("name", list(REPRESENTATIVE))
def test_every_key_either_separates_the_runs_or_is_one_the_run_axis_carries(name, configs):
    """The walk covers every leaf of the identity; a variant that keeps the batch key keeps the job (and is
    trained below); one that changes it is a job of its own for the runner and a refusal for ``check_batchable``."""
    config = configs[name]
    together, apart = variants(config)
    walked = {dotted(p) for p, _ in together} | set(apart)
    assert {k for k in flatten(config) if k.split(".")[0] not in INVOCATION} <= walked
    for key, variant in apart.items():
        assert batch_groups([0, 1], [config, variant], None) == [[0], [1]], key
        with pytest.raises(ConfigError, match="cannot share a batch|one process per device"):
            check_batchable([config, variant])
    for key in ("model.drop_last", "model.executor", "model.aggregation", "data.val_fraction", "data.num_clients"):
        assert key in apart  # the keys of issue 40's reports, each a job of its own
    assert any(k.startswith("model.algorithm.") and k != "model.algorithm.class_path" for k in apart)
    assert {dotted(p) for p, _ in together} >= {"seed_everything", "trainer.max_steps"}


def comparable(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """``summary.json`` without the record of what ran and the wall time, and ``metrics.csv``'s rows."""
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("ran", "wall_s"):
        summary.pop(key, None)
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return summary, rows


def train_args(path: tuple[str, ...], value: Any) -> list[str]:
    return [f"--{'.'.join(path)}", json.dumps(value) if not isinstance(value, str) else value]


#: the representative whose job also holds a variant of every key a resume may change (rounds, logging, W&B,
#: checkpoint cadence: the same keys for every run, so once; the others vary the keys the run axis carries per run)
RESUME_KEYS_ON = "fedavg_dp"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REPRESENTATIVE))
def test_runs_that_share_a_job_give_exactly_their_numbers_alone(name, configs, tmp_path):
    """Every variant that keeps the batch key, in one batched job with the run itself, against each run alone (a
    variant that train.py refuses alone, e.g. ``trainer.max_time`` given a number, has nothing to batch with)."""
    together, _ = variants(configs[name])
    candidates: dict[str, list[str]] = {"base": list(REPRESENTATIVE[name])}
    for path, value in together:
        if name != RESUME_KEYS_ON and under(dotted(path), RESUME_MAY_CHANGE):
            continue
        candidates[dotted(path)] = [*REPRESENTATIVE[name], *train_args(path, value)]
    runs: dict[str, list[str]] = {}
    for key, args in candidates.items():
        try:
            train_config([], [*args, "--run_dir", str(tmp_path / "alone" / key)])
        except ConfigError:
            continue
        runs[key] = args
    assert {"base", "seed_everything", "data.seed"} <= set(runs)
    arg_lists = [[*a, "--run_dir", str(tmp_path / "batched" / k)] for k, a in runs.items()]
    outcomes = BatchedRuns(arg_lists, list(runs)).run()
    assert [o.status for o in outcomes] == ["done"] * len(runs), [(k, o.error) for k, o in zip(runs, outcomes)]
    for key in runs:
        batched, alone = comparable(tmp_path / "batched" / key), comparable(tmp_path / "alone" / key)
        assert batched == alone, f"{name}: the run that differs in {key} gives other numbers batched"
        ran = json.loads((tmp_path / "batched" / key / "summary.json").read_text())["ran"]
        assert ran["batch"]["runs"] == list(runs) and ran["executor"] in ("stacked", "sequential")
