"""The tuning stage of the experiment runner (issue 31, item 4): grid points on the validation split with tuning
seeds, the best validation mean wins, then only the winner runs with the experiment's own seeds on the test split.

Training runs are tiny (digits, 2 rounds); the reference winner is recomputed here from the tuning runs' own
``history.json`` files.
"""

from __future__ import annotations

import json
import re
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


# ---- the grid extension (issue 44, fl_lightning/experiment/tuning.py) ----------------------------------------------
def extending(extend: int, lr: list, mu: list, **tune) -> dict:
    """FedProx with an lr × mu grid and ``extend`` extensions; the runs are never trained (a fake objective)."""
    data = tuned(tune={"seeds": [100, 101], "val_fraction": 0.25, "extend": extend, **tune})
    data["axes"]["method"] = {
        "fedprox": {"config": f"{DIGITS}/fedprox.yaml",
                    "tune": {"grid": {"model.lr": lr, "model.algorithm.init_args.mu": mu}}},
    }  # fmt: skip
    return data


def fake_stage(objective, fails=lambda lr, mu: False):
    """``run`` for extend_grids: each tuning run's summary.json holds objective(lr, mu) plus a seed-dependent
    wobble (so the choice is a mean over seeds); a run where ``fails`` holds writes nothing and fails."""
    from fl_lightning.experiment.runner import Outcome

    calls: list[list[str]] = []

    def run(experiment, specs):
        calls.append([str(s.run_dir) for s in specs])
        outcomes = []
        for spec in specs:
            lr = float(next(o for o in spec.overrides if o.startswith("--model.lr=")).split("=")[1])
            mu = float(next(o for o in spec.overrides if o.startswith("--model.algorithm.init_args.mu=")).split("=")[1])
            spec.run_dir.mkdir(parents=True, exist_ok=True)
            if fails(lr, mu):
                outcomes.append(Outcome(spec, "failed", "diverged"))
                continue
            wobble = 1e-4 * (spec.seed - 100.5)
            (spec.run_dir / "summary.json").write_text(json.dumps({"last10": objective(lr, mu) + wobble}))
            outcomes.append(Outcome(spec, "done"))
        return outcomes

    return run, calls


def grown_choice(data, objective, fails=lambda lr, mu: False):
    """The base grid's runs, its choice, then extend_grids, as the runner chains them."""
    import io

    from fl_lightning.experiment.tuning import extend_grids

    experiment = parse_experiment(data, runs_dir=Path(data.pop("_runs")))
    run, calls = fake_stage(objective, fails)
    tuning = experiment.tuning_runs()
    run(experiment, [t.run for t in tuning])
    lost = set()
    choices = runner.choose(experiment, tuning, lost)
    tuning, outcomes, choices = extend_grids(experiment, [], tuning, choices, run, runner.choose, io.StringIO())
    return choices[("fedprox",)], tuning, calls[1:]


def peak(lr_star: float, mu_star: float):
    """A concave objective in (log lr, mu) with its maximum at (lr_star, mu_star)."""
    import math

    return lambda lr, mu: 1.0 - (math.log(lr) - math.log(lr_star)) ** 2 - (mu - mu_star) ** 2


def test_an_edge_winner_grows_its_axis_on_the_log_scale_until_interior(tmp_path):
    """lr's grid [0.01, 0.05] with the optimum near 0.3: the tuner adds 0.25 (× 5, the grid's own ratio), then
    1.25, and stops there because 0.25 is interior; mu's winner is interior from the start (never extended)."""
    data = extending(3, [0.01, 0.05], [0.0, 0.1, 0.2])
    data["_runs"] = tmp_path
    choice, tuning, calls = grown_choice(data, peak(0.3, 0.1))
    points = {t.point for t in tuning}
    assert {"lr=0.25+mu=0.1", "lr=1.25+mu=0.1"} <= points and len(points) == 2 * 3 + 2
    assert [len(c) for c in calls] == [2, 2]  # one new point × 2 tuning seeds per extension
    assert choice.point == "lr=0.25+mu=0.1" and choice.edges == [] and choice.trials == 16
    # the reference: the best mean over seeds of the objective over the points tried
    f = peak(0.3, 0.1)
    tried = [(float(p.split("+")[0][3:]), float(p.split("+")[1][3:])) for p in points]
    best = max(tried, key=lambda v: f(*v))
    assert choice.point == f"lr={best[0]:g}+mu={best[1]:g}"
    assert choice.overrides == ["--model.lr=0.25", "--model.algorithm.init_args.mu=0.1"]


def test_the_budget_stops_the_extension_and_the_winner_is_flagged(tmp_path):
    """The optimum at lr = 100: with 2 extensions the winner ends at lr = 1.25 (0.05 × 5²), flagged with the budget
    that stopped it; the label in the table carries the flag."""
    data = extending(2, [0.01, 0.05], [0.0, 0.1, 0.2])
    data["_runs"] = tmp_path
    choice, _, calls = grown_choice(data, peak(100.0, 0.1))
    assert len(calls) == 2 and choice.point == "lr=1.25+mu=0.1"
    assert choice.edges == ["lr=1.25 at the upper edge (budget (2 extensions))"]
    assert choice.label == "lr=1.25+mu=0.1 [edge: lr=1.25 at the upper edge (budget (2 extensions))]"
    assert choice.record()["edges"] == choice.edges


def test_a_linear_axis_steps_by_its_difference_and_stops_at_its_bound(tmp_path):
    """mu's grid [0.1, 0.2] (linear: not a learning rate) with the optimum below 0: the next value down is 0.0
    (0.1 − 0.1), then the default bound 0 of a non-negative axis stops it, and the winner is flagged with it.
    A declared bound [0.05, null] clips the step to 0.05 instead."""
    data = extending(3, [0.01, 0.05, 0.25], [0.1, 0.2])
    data["_runs"] = tmp_path / "a"
    choice, tuning, _ = grown_choice(data, peak(0.05, -1.0))
    assert "lr=0.05+mu=0.0" in {t.point for t in tuning}
    assert choice.point == "lr=0.05+mu=0.0" and choice.edges == ["mu=0.0 at the lower edge (bound 0)"]
    data = extending(3, [0.01, 0.05, 0.25], [0.1, 0.2], bounds={"model.algorithm.init_args.mu": [0.05, None]})
    data["_runs"] = tmp_path / "b"
    choice, _, _ = grown_choice(data, peak(0.05, -1.0))
    assert choice.point == "lr=0.05+mu=0.05" and choice.edges == ["mu=0.05 at the lower edge (bound 0.05)"]


def test_a_failed_extension_point_is_tried_and_lost(tmp_path):
    """The runs at lr ≥ 1 diverge (fail): lr = 1.25 cannot win and does not block the choice; 0.25 is then inside
    the values tried, so it is not flagged."""
    data = extending(3, [0.01, 0.05], [0.0, 0.1, 0.2])
    data["_runs"] = tmp_path
    choice, _, calls = grown_choice(data, peak(100.0, 0.1), fails=lambda lr, mu: lr >= 1)
    assert len(calls) == 2 and choice.point == "lr=0.25+mu=0.1" and choice.edges == []
    assert choice.lost == ["lr=1.25+mu=0.1"] and "lr=1.25+mu=0.1" not in choice.means


def test_outward_values_on_each_scale():
    from fl_lightning.experiment.tuning import axis_bounds, axis_scale, outward

    assert axis_scale("model.lr", [0.01, 0.05], {}) == "log" and axis_scale("model.server_lr", [0.5, 1.0], {}) == "log"
    assert axis_scale("x.mu", [0.01, 0.1], {}) == "linear" and axis_scale("x.mu", [0.01, 0.1, 1.0], {}) == "log"
    assert axis_scale("x.mu", [0.01, 0.1], {"x.mu": "log"}) == "log" and axis_scale("x.lr", [0.0, 0.1], {}) == "linear"
    assert axis_bounds("e", [1, 5], {}) == (1, None) and axis_bounds("m", [0.0, 0.1], {}) == (0, None)
    assert axis_bounds("m", [-1.0, 1.0], {}) == (None, None) and axis_bounds("m", [0.1], {"m": (0.2, 1)}) == (0.2, 1)
    for values, side, scale in [([0.01, 0.05], "upper", "log"), ([0.01, 0.05], "lower", "log"),
                                ([0.1, 0.75], "upper", "linear"), ([0.0001, 0.001], "lower", "log")]:  # fmt: skip
        lo, hi = sorted(values)
        want = (hi * hi / lo if scale == "log" else 2 * hi - lo) if side == "upper" else (lo * lo / hi)
        assert outward(values, side, scale, (None, None)) == (pytest.approx(want), "")
    assert outward([1, 5], "upper", "linear", (1, None)) == (9, "")  # integers stay integers
    assert outward([1, 5], "lower", "linear", (1, None)) == (None, "bound 1")  # 1 is already the bound
    assert outward([2, 5], "lower", "linear", (1, None)) == (1, "")  # −1 is clipped to the bound once
    assert outward([1, 2], "upper", "log", (None, 3)) == (3, "")  # 4 is clipped to 3
    assert outward([5, 10], "upper", "linear", (None, None))[0] == 15 and isinstance(outward([1, 2], "upper",
                                                                                              "log", (1, None))[0], int)


def test_extend_is_set_once_at_the_top_level_and_checked():
    data = extending(2, [0.01, 0.05], [0.0, 0.1])
    experiment = parse_experiment(data)
    assert experiment.axes["method"][0].tune.extend == 2
    for change, words in [
        ({"extend": -1}, "tune.extend: expected a number of extensions ≥ 0"),
        ({"extend": True}, "tune.extend: expected a number of extensions ≥ 0"),
        ({"scale": {"model.lr": "exp"}}, "scale.model.lr: expected log or linear"),
        ({"bounds": {"model.lr": [1, 0]}}, "bounds.model.lr: expected [low, high]"),
    ]:
        bad = extending(2, [0.01, 0.05], [0.0, 0.1])
        bad["tune"].update(change)
        with pytest.raises(ExperimentError, match=re.escape(words)):
            parse_experiment(bad)
    bad = extending(2, [0.01, 0.05], [0.0, 0.1])
    bad["axes"]["method"]["fedprox"]["tune"]["extend"] = 3
    with pytest.raises(ExperimentError, match="extend is set once, at the top level"):
        parse_experiment(bad)
    bad = extending(2, [0.01, 0.05], [0.0, 0.1])
    bad["axes"]["method"]["fedprox"]["tune"]["scale"] = {"model.momentum": "log"}
    with pytest.raises(ExperimentError, match="not a key of this method's grid"):
        parse_experiment(bad)


@pytest.mark.slow
def test_the_runner_extends_an_edge_winner_with_real_runs(tmp_path):
    """Through ``python -m fl_lightning.experiment run`` (FedAvg, 2 rounds, lr grid [0.001, 0.002], extend 1): the
    winner of the base grid is on an edge (a 2-point grid has no interior), so one point outward runs with both tuning
    seeds; the choice is the best mean of last10 over all 3 points (recomputed from the runs' history.json), and a
    winner left on an edge is flagged in tune.json and in the table's "chosen" column."""
    data = tuned("grown", tune={"seeds": [100, 101], "val_fraction": 0.25, "extend": 1})
    data["axes"]["method"]["fedavg"]["tune"]["grid"]["model.lr"] = [0.001, 0.002]
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    out = tmp_path / "runs" / "grown"
    points = sorted(p.name for p in (out / "tune" / "fedavg").iterdir())
    assert len(points) == 3 and {"lr=0.001", "lr=0.002"} < set(points)
    means = {}
    for point in points:
        values = [last10(json.loads((out / "tune" / "fedavg" / point / f"s{s}" / "history.json").read_text()))
                  for s in (100, 101)]  # fmt: skip
        means[point] = statistics.fmean(values)
    record = json.loads((out / "tune.json").read_text())[0]
    best = max(means, key=means.get)
    assert record["chosen"] == best and record["trials"] == 6 and record["means"] == pytest.approx(means)
    lrs = sorted(float(p.split("=")[1]) for p in points)
    on_edge = float(best.split("=")[1]) in (lrs[0], lrs[-1])
    assert bool(record["edges"]) == on_edge
    row = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith("| fedavg"))
    if on_edge:
        assert f"[edge: {best} at the " in row and "edge (budget (1 extension))]" in row
    else:
        assert "[edge:" not in row
