"""The tuning stage of the experiment runner (issue 31, item 4): grid points on the validation split with tuning
seeds, the best validation mean wins, then only the winner runs with the experiment's own seeds on the test split.

Training runs are tiny (digits, 2 rounds); the reference winner is recomputed here from the tuning runs' own
``history.json`` files.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from fl_lightning.engine.client_data import FederatedData
from fl_lightning.experiment import runner
from fl_lightning.experiment.__main__ import main
from fl_lightning.experiment.spec import ExperimentError, parse_experiment

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits")
LRS = [0.001, 0.2]


def tuned(name: str = "tuned", **more) -> dict:
    """FedAvg with a 2-point lr grid × 2 tuning seeds, then seed 0 on the test split; 2 rounds, W&B off."""
    data = {
        "name": name,
        "configs": [f"{DIGITS}/base.yaml"],
        "axes": {
            "method": {"fedavg": {"config": f"{DIGITS}/fedavg.yaml", "tune": {"grid": {"model.lr": LRS}}}},
            "seed": [0],
        },
        "set": {"trainer.max_steps": 2, "trainer.enable_progress_bar": False, "data.init_args.num_clients": 10},
        "tune": {"seeds": [100, 101], "val_fraction": 0.25},
        "wandb": {"mode": "disabled"},
    }
    data.update(more)
    return data


def last10(history: list[dict], key: str = "val/acc_mean") -> float:
    values = [h[key] for h in history][-10:]
    return sum(values) / len(values)


def test_choose_takes_the_best_mean_over_tuning_seeds_and_refuses_a_missing_run(tmp_path):
    """Fabricated tuning summaries: the winner is the argmax of the per-point mean (not the best single seed)."""
    import numpy as np

    data = tuned()
    data["axes"]["method"]["fedavg"]["tune"]["grid"]["model.momentum"] = [0.0, 0.9]
    experiment = parse_experiment(data, runs_dir=tmp_path)
    tuning = experiment.tuning_runs()
    rng = np.random.default_rng(0)
    values = rng.uniform(0.1, 0.9, size=(4, 2))
    values[1] = [0.99, 0.01]  # the best single run, a poor mean
    points = list(dict.fromkeys(t.point for t in tuning))
    for t in tuning:
        t.run.run_dir.mkdir(parents=True)
        i, j = points.index(t.point), [100, 101].index(t.run.seed)
        (t.run.run_dir / "summary.json").write_text(json.dumps({"last10": values[i, j], "final": 1.0 - values[i, j]}))
    choice = runner.choose(experiment, tuning)[("fedavg",)]
    assert choice.point == points[int(np.argmax(values.mean(1)))] and choice.trials == 8
    lr, momentum = choice.point.split("+")
    assert choice.overrides == [f"--model.{lr}", f"--model.{momentum}"]
    assert choice.means == pytest.approx(dict(zip(points, values.mean(1))))
    (tuning[3].run.run_dir / "summary.json").unlink()
    assert runner.choose(experiment, tuning)[("fedavg",)].point is None


@pytest.mark.slow
def test_winner_is_the_best_validation_mean_and_tuning_never_reads_test(tmp_path, monkeypatch):
    reads: list[tuple[str, str]] = []  # (run dir, split) of every evaluation read
    current = {"dir": ""}
    real_split = FederatedData.evaluation_split
    real_run = runner.run_in_process

    def spy_split(self, which="test"):
        reads.append((current["dir"], which))
        return real_split(self, which)

    def spy_run(args, log_path):
        current["dir"] = str(Path(log_path).parent)
        return real_run(args, log_path)

    monkeypatch.setattr(FederatedData, "evaluation_split", spy_split)
    monkeypatch.setattr(runner, "run_in_process", spy_run)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(tuned()))
    # one run per call (batch 1) so that the spy knows which run reads which split: a batched job runs many at once
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--batch-runs", "1"]) == 0

    out = tmp_path / "runs" / "tuned"
    tune_dirs = sorted(p.parent for p in (out / "tune").rglob("summary.json"))
    assert len(tune_dirs) == len(LRS) * 2
    # the reference: the mean over tuning seeds of last10 of val/acc_mean, from each run's history.json
    means = {}
    for lr in LRS:
        point = out / "tune" / "fedavg" / f"lr={lr}"
        values = [last10(json.loads((point / f"s{s}" / "history.json").read_text())) for s in (100, 101)]
        means[f"lr={lr}"] = statistics.fmean(values)
        for s in (100, 101):
            config = yaml.safe_load((point / f"s{s}" / "config.yaml").read_text())
            assert config["seed_everything"] == s and config["model"]["lr"] == lr
            assert config["data"]["init_args"]["val_fraction"] == 0.25
    best = max(means, key=means.get)
    record = json.loads((out / "tune.json").read_text())
    assert [r["chosen"] for r in record] == [best] and record[0]["trials"] == 4
    assert record[0]["means"] == pytest.approx(means)
    # only the winner runs with the fresh seed, on all training rows and the test split
    final = yaml.safe_load((out / "fedavg" / "s0" / "config.yaml").read_text())
    assert final["model"]["lr"] == float(best.split("=")[1]) and final["seed_everything"] == 0
    assert final["data"]["init_args"]["val_fraction"] == 0.0
    # the tuning stage read the validation split only; the final run read the test split
    tuning_reads = {split for d, split in reads if "/tune/" in d}
    final_reads = {split for d, split in reads if d.endswith("fedavg/s0")}
    assert tuning_reads == {"val"} and final_reads == {"test"}
    assert {d for d, _ in reads if "/tune/" in d} == {str(d) for d in tune_dirs}
    for d in tune_dirs:
        history = json.loads((d / "history.json").read_text())
        assert all(k.startswith("val/") or k == "round" for h in history for k in h)
    # the table names the chosen value and the trials
    table = (out / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| fedavg"))
    assert f"| {best} " in row and "| 4 " in row
    # a second run skips every finished run (tuning ones too) and chooses the same
    reads.clear()
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--batch-runs", "1"]) == 0
    assert reads == [] and json.loads((out / "tune.json").read_text()) == record


@pytest.mark.parametrize(
    "change, words",
    [
        ({"tune": {"seeds": [0, 1]}}, "axes.seed: seed 0 is also a tuning seed"),
        ({"tune": {"budget": "fair"}}, "tune.budget: expected equal or free"),
        ({"tune": {"metric": "last_10"}}, "tune.metric: 'last_10' is not a summary.json figure; did you mean last10?"),
        ({"tune": {"grid": {"model.lr": [0.1]}}}, "tune.grid: unknown key at the top level"),
        ({"method_tune": {"grid": {"model.lr": []}}}, "axes.method.fedavg.tune.grid.model.lr: expected a non-empty"),
        ({"method_tune": {"grid": {"model.lr": [0.1, 0.1]}}}, "a value is given twice"),
        ({"method_tune": {"grid": {"model.lr": [0.1]}, "val_fraction": 0}}, "tune.val_fraction: expected a fraction"),
        ({"method_tune": {"grid": {"model.lr": [0.1]}, "lr": 1}}, "axes.method.fedavg.tune.lr: unknown key"),
        ({"method_tune": [0.1]}, "axes.method.fedavg.tune: expected a mapping"),
        ({"fedrep_tune": {"grid": {"model.lr": [0.1, 0.2, 0.3]}}}, "unequal tuning budgets: fedavg gets 4 trials, "
                                                                   "fedrep 6"),
    ],
)
def test_a_bad_tune_block_is_one_line(change, words):
    data = tuned()
    data["axes"]["method"]["fedrep"] = {"config": f"{DIGITS}/fedrep.yaml", "tune": {"grid": {"model.lr": LRS}}}
    if "tune" in change:
        data["tune"] = {**data["tune"], **change["tune"]}
    if "method_tune" in change:
        data["axes"]["method"]["fedavg"]["tune"] = change["method_tune"]
    if "fedrep_tune" in change:
        data["axes"]["method"]["fedrep"]["tune"] = change["fedrep_tune"]
    with pytest.raises(ExperimentError) as exc:
        parse_experiment(data)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_budget_free_allows_unequal_grids_and_a_method_without_tune_counts_zero():
    data = tuned()
    data["axes"]["method"]["local"] = {"config": f"{DIGITS}/local.yaml"}
    with pytest.raises(ExperimentError, match="local gets 0 trials, fedavg 4"):
        parse_experiment(data)
    data["tune"]["budget"] = "free"
    experiment = parse_experiment(data)
    runs = experiment.tuning_runs()
    assert [t.run.run_dir.parts[-4:] for t in runs] == [
        ("tune", "fedavg", f"lr={lr}", f"s{s}") for lr in LRS for s in (100, 101)
    ]
    assert all("--data.init_args.val_fraction=0.25" in t.run.args() for t in runs)


def test_the_tuned_digits_table_expands_with_equal_budgets():
    from fl_lightning.experiment.spec import load_experiment

    experiment = load_experiment(ROOT / "configs" / "experiments" / "pfl_tuned_digits.yaml")
    methods = experiment.axes["method"]
    assert len(methods) == 23 and all(p.tune is not None for p in methods)
    assert len({p.tune.trials for p in methods}) == 1
    assert len(experiment.tuning_runs()) == 23 * methods[0].tune.trials
