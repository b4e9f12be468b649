"""The experiment runner (``fl_lightning/experiment/runner.py``, through ``python -m fl_lightning.experiment``):
grids run, skip/resume, compare, sweeps, workers (the file format, validation and the command line's refusals have
their own files). Training runs here are tiny (digits, 3-12 rounds); the full grids (configs/experiments/*.yaml) are
only expanded and parsed.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fl_lightning.experiment.__main__ import main
from tests.helpers.experiment_files import DIGITS, ROOT, tiny, tree, write_experiment


def last10_from_csv(run_dir: Path) -> float:
    """The mean of the last 10 evaluations of val/acc_mean, read from metrics.csv (one value per step)."""
    by_step: dict[int, float] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row.get("val/acc_mean"):
                by_step[int(row["step"])] = float(row["val/acc_mean"])
    values = [by_step[s] for s in sorted(by_step)][-10:]
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory) -> tuple[Path, Path, int, str]:
    """The tiny grid (2 methods × 2 seeds, 3 rounds, batched by default: one job per method, in process) run once with
    W&B offline, shared by the run/rerun/compare checks and the W&B checks below (two batched jobs, not four runs).
    Returns the experiment file, the runs folder, the exit code and what the runner printed."""
    folder = tmp_path_factory.mktemp("tiny_grid")
    data = tiny()
    del data["wandb"]  # the default: online when logged in, offline otherwise (here WANDB_MODE=offline)
    path = write_experiment(folder, data)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        code = main(["run", str(path), "--runs-dir", str(folder / "runs")])
    return path, folder / "runs", code, out.getvalue()


def test_run_then_rerun_skips_and_compare_matches_the_metrics_csv(tiny_grid, tmp_path, capsys):
    path, runs, code, out = tiny_grid
    assert code == 0
    assert out.strip().splitlines()[-1] == f"results: {runs / 'tiny' / 'results.json'}"
    assert "mean ± std" in out and "%" in out
    dirs = {m: [runs / "tiny" / m / "digits" / f"s{s}" for s in (0, 1)] for m in ("fedavg", "fedrep")}
    for d in sum(dirs.values(), []):
        meta = json.loads((d / "run.json").read_text())
        assert meta["command"].startswith("python train.py") and meta["axes"]["method"] == d.parent.parent.name
        assert (d / "train.log").read_text().count("====") == 1
    assert (runs / "tiny" / "curve_val_acc_mean.png").stat().st_size > 0
    stamps = {d: (d / "summary.json").stat().st_mtime_ns for d in sum(dirs.values(), [])}

    # the same command again: nothing is redone
    assert main(["run", str(path), "--runs-dir", str(runs)]) == 0
    captured = capsys.readouterr()
    assert "4 finished run(s) skipped" in captured.err
    assert stamps == {d: (d / "summary.json").stat().st_mtime_ns for d in stamps}

    # compare on the run dirs (and a folder holding them) = an independent computation from metrics.csv
    assert main(["compare", str(runs / "tiny" / "fedavg"), *map(str, dirs["fedrep"]), "--format", "csv",
                 "--out", str(tmp_path / "cmp")]) == 0  # fmt: skip
    text = capsys.readouterr().out
    rows = list(csv.DictReader(line for line in text.splitlines() if "," in line))
    assert [r["method"] for r in rows] == ["fedavg", "fedrep"]
    for row in rows:
        values = np.array([last10_from_csv(d) for d in dirs[row["method"]]]) * 100
        assert float(row["last10 mean (%)"]) == pytest.approx(values.mean(), abs=1e-3)
        assert float(row["last10 std (%)"]) == pytest.approx(values.std(ddof=1), abs=1e-3)
        assert row["n"] == "2"
    records = json.loads((tmp_path / "cmp" / "results.json").read_text())
    per_run = [r for r in records if r["metric"] == "acc_last10"]
    assert sorted((r["method"], r["seed"]) for r in per_run) == [("fedavg", 0), ("fedavg", 1), ("fedrep", 0),
                                                                ("fedrep", 1)]  # fmt: skip
    for r in per_run:  # fractions in results.json
        assert r["value"] == pytest.approx(last10_from_csv(dirs[r["method"]][r["seed"]]), abs=1e-6)


def test_train_py_refuses_an_experiments_folder_as_its_run_dir(tiny_grid, capsys):
    """A run written into runs/<name>/ would make compare take that folder for one run and skip the grid's runs."""
    from tests.helpers.training import train_here

    _, runs, _, _ = tiny_grid
    before = sorted(str(p) for p in runs.rglob("*"))
    for folder in (runs / "tiny", runs / "tiny" / "fedavg"):
        code = train_here(["--config", f"{DIGITS}/base.yaml", "--config", f"{DIGITS}/fedavg.yaml", "--run_dir",
                           str(folder), "--trainer.max_steps", "1", "--wandb.mode", "disabled"])  # fmt: skip
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "holds an experiment's runs in its subfolders" in lines[0], lines
    assert sorted(str(p) for p in runs.rglob("*")) == before


@pytest.fixture(scope="module")
def finished_tiny(tmp_path_factory) -> Path:
    """A finished one-round grid (2 methods, seed 0) with its report; returns its folder (``exp.yaml``, ``runs/``)."""
    folder = tmp_path_factory.mktemp("finished_tiny")
    path = write_experiment(folder, tiny(rounds=1, seeds=[0]))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["run", str(path), "--runs-dir", str(folder / "runs")]) == 0
    assert all((folder / "runs" / "tiny" / name).is_file() for name in ("results.json", "commands.sh"))
    return folder


#: reruns of a finished grid that are refused: arguments after ``run exp.yaml --runs-dir runs`` -> the one line
REFUSED_RERUNS = {
    "another learning rate (every run dir holds a run of other arguments)": (
        ["--set", "model.lr=0.05"], "runs/tiny/fedavg/digits/s0 (and 1 more run dirs) holds a run with other "
        "training arguments (its run.json); fix: --overwrite reruns them"),
    "a value of the wrong type": (["--set", "model.lr=abc"], "model.lr: value 'abc' given"),
    "an override of a key that does not exist": (["--set", "model.nope=1"], "unrecognized arguments: --model.nope=1"),
    "--set without a value": (["--set", "model.lr"], "--set model.lr: expected KEY=VALUE"),
    "a report metric no run has": (["--metric", "last1"], "did you mean last10?"),
    "a curve that is not a metrics.csv column": (["--curve", "acc_mean"], "--curve: expected a metrics.csv column"),
    "--by an axis the file does not have": (["--by", "methods"], "--by methods: not an axis"),
    "--jobs 0": (["--jobs", "0"], "--jobs 0: expected ≥ 1"),
    "--batch-runs 0": (["--batch-runs", "0"], "--batch-runs 0: expected ≥ 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED_RERUNS))
def test_a_refused_rerun_leaves_every_file_byte_identical(case, finished_tiny, capsys, monkeypatch):
    """Refused whole, in one line (exit code 2), before any run starts: the runs, their logs, commands.sh and the
    report (results.json, the table, the plots) keep their bytes; a rerun refused because its run dirs hold runs of
    other arguments neither trains the others nor reports those runs as its own."""
    args, expected = REFUSED_RERUNS[case]
    monkeypatch.chdir(finished_tiny)
    before = tree(finished_tiny)
    code = main(["run", "exp.yaml", "--runs-dir", "runs", *args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert tree(finished_tiny) == before


def test_a_failing_run_is_reported_and_the_others_go_on(tmp_path, capsys):
    data = tiny(seeds=[0])
    # FedRep with a personal prefix that matches no parameter fails at set-up; FedAvg still runs
    data["axes"]["method"]["fedrep"] = {"config": f"{DIGITS}/fedrep.yaml",
                                        "model.algorithm.init_args.personal": ["nothing."]}  # fmt: skip
    path = write_experiment(tmp_path, data)
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 1
    captured = capsys.readouterr()
    failed = tmp_path / "runs" / "tiny" / "fedrep" / "digits" / "s0"
    assert f"failed: {failed}" in captured.err and "matches no parameter" in captured.err
    assert "rerun alone: python train.py" in captured.err
    assert (tmp_path / "runs" / "tiny" / "fedavg" / "digits" / "s0" / "summary.json").exists()
    assert "fedavg" in captured.out and "results:" in captured.out


@pytest.mark.slow
def test_interrupt_then_rerun_finishes_only_the_unfinished_runs(tmp_path):
    """Ctrl-C (SIGINT) in the middle of the grid, then the same command: finished runs are not redone, the
    interrupted one resumes from its checkpoint, the rest start. One run at a time (``batch_runs: 1``): batched
    runs finish together (tests/experiment/test_batch_runs.py interrupts a batch)."""
    path = write_experiment(tmp_path, tiny(rounds=12, batch_runs=1))
    runs = tmp_path / "runs" / "tiny"
    cmd = [sys.executable, "-m", "fl_lightning.experiment", "run", str(path), "--runs-dir", str(tmp_path / "runs")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    first = runs / "fedavg" / "digits" / "s0"
    second = runs / "fedavg" / "digits" / "s1"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((first / "summary.json").exists() and any((second / "checkpoints").glob("*.ckpt"))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "run the same command again" in err
    assert not (second / "summary.json").exists() or "interrupted" in (second / "train.log").read_text()
    stamp = (first / "summary.json").stat().st_mtime_ns

    # the same command again, in this process (the interrupted one had to be another process)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 0
    finally:
        os.chdir(cwd)
    assert (first / "summary.json").stat().st_mtime_ns == stamp  # not redone
    assert (first / "train.log").read_text().count("====") == 1
    log = (second / "train.log").read_text()
    assert log.count("====") == 2 and "--ckpt_path last" in log.split("====")[-1]  # resumed
    for d in runs.glob("*/digits/s*"):
        assert json.loads((d / "summary.json").read_text())["rounds"] == 12


class FakeRun:
    def __init__(self, name, method, seed, last10, curve, state="finished"):
        self.id, self.name, self.group, self.job_type, self.state = f"id-{name}", name, "exp", method, state
        self.tags = [f"method:{method}", "dataset:digits", f"seed:{seed}"]
        self.config = {"seed_everything": seed}
        self.summary = {"summary/last10": last10, "summary/final": curve[-1], "summary/metric": "acc",
                        "val/acc_mean": curve[-1]}  # fmt: skip
        self.curve = curve

    def scan_history(self, keys=None, page_size=None):
        for step, v in enumerate(self.curve):
            yield {"trainer/global_step": step, "val/acc_mean": v}


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None, **kwargs):
        self.calls.append((path, filters))
        return [r for r in self._runs if r.group == (filters or {}).get("group")]


def test_compare_reads_a_wandb_group_through_the_public_api(tmp_path, monkeypatch, capsys):
    import wandb

    runs = [
        FakeRun("fedavg-digits-s0", "fedavg", 0, 0.70, [0.5, 0.7]),
        FakeRun("fedavg-digits-s1", "fedavg", 1, 0.74, [0.6, 0.74]),
        FakeRun("fedavg-digits-s2", "fedavg", 2, 0.10, [0.1], state="running"),  # left out
        FakeRun("fedrep-digits-s0", "fedrep", 0, 0.98, [0.9, 0.98]),
    ]
    api = FakeApi(runs)
    monkeypatch.setattr(wandb, "Api", lambda *a, **k: api)
    out_dir = tmp_path / "out"
    assert main(["compare", "--wandb", "me/proj", "--group", "exp", "--out", str(out_dir), "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert api.calls == [("me/proj", {"group": "exp"})]
    line = next(ln for ln in text.splitlines() if ln.startswith("| fedavg"))
    mean, std = np.mean([70.0, 74.0]), np.std([70.0, 74.0], ddof=1)
    assert f"{mean:.2f} ± {std:.2f}" in line and line.rstrip(" |").endswith("2")
    assert "| fedrep" in text and "98.00" in text
    assert (out_dir / "curve_val_acc_mean.png").exists()
    records = json.loads((out_dir / "results.json").read_text())
    assert {(r["method"], r["seed"]) for r in records if r["metric"] == "acc_last10"} == {
        ("fedavg", 0), ("fedavg", 1), ("fedrep", 0)}  # fmt: skip


def test_offline_wandb_gets_one_named_grouped_tagged_run_per_point(tiny_grid):
    from fl_lightning.wandb_files import offline_runs

    _, runs_dir, code, _ = tiny_grid
    assert code == 0
    runs = offline_runs(runs_dir, wait_s=60)
    assert len(runs) == 4 and len({r.id for r in runs}) == 4
    assert sorted(r.name for r in runs) == ["fedavg-digits-s0", "fedavg-digits-s1", "fedrep-digits-s0",
                                            "fedrep-digits-s1"]  # fmt: skip
    for r in runs:
        method, _, seed = r.name.split("-")
        assert r.group == "tiny" and r.job_type == method and r.project == "fl_lightning"
        assert r.tags == [f"method:{method}", "dataset:digits", f"seed:{seed[1:]}"]
        # the full resolved config: data, algorithm, model, trainer
        assert r.config["data"]["class_path"] == "datamodules.DigitsDataModule"
        assert r.config["data"]["init_args"]["num_clients"] == 20
        assert r.config["model"]["algorithm"]["class_path"].endswith({"fedavg": "FedAvg", "fedrep": "FedRep"}[method])
        assert r.config["model"]["network"]["class_path"] == "fl_lightning.models.DigitsMLP"
        assert r.config["trainer"]["max_steps"] == 3 and r.config["seed_everything"] == int(seed[1:])
        run_dir = runs_dir / "tiny" / method / "digits" / seed
        assert r.files[0].is_relative_to(run_dir)  # the W&B files live in the run's own dir
        final = json.loads((run_dir / "summary.json").read_text())["final"]
        assert r.summary["val/acc_mean"] == pytest.approx(final, abs=1e-6)


@pytest.mark.slow
def test_jobs_runs_workers_with_a_log_each(worker_grid):
    """FedRep × 2 seeds, ``--jobs 2``, from a folder with the default runs dir (tests/experiment/conftest.py;
    test_batch_runs.py reads the same run)."""
    folder, code, out, _ = worker_grid
    assert code == 0
    assert "| fedrep" in out
    for seed in (0, 1):
        run_dir = folder / "runs" / "workers" / "fedrep" / f"s{seed}"
        log = (run_dir / "train.log").read_text()
        assert "run: runs/workers/fedrep" in log and "FedRep" in log  # train.py's own result table
        assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


def test_compare_groups_plain_train_py_run_dirs_by_algorithm(tmp_path, capsys):
    """Run dirs that no experiment made (no run.json): the method is the summary's algorithm, the seed the
    config's seed_everything; a folder is searched for run dirs below it."""
    values = {("FedAvg", 0): 0.5, ("FedAvg", 1): 0.6, ("FedRep", 0): 0.9, ("FedRep", 1): 0.95}
    for (algorithm, seed), last10 in values.items():
        d = tmp_path / "mine" / f"{algorithm}_{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"algorithm": algorithm, "rounds": 2, "final": last10,
                                                    "last10": last10, "metric": "acc"}))  # fmt: skip
        (d / "config.yaml").write_text(f"seed_everything: {seed}\ntrainer:\n  max_steps: 2\n")
        (d / "metrics.csv").write_text(f"epoch,step,val/acc_mean\n0,0,{last10 / 2}\n0,1,{last10}\n")
    assert main(["compare", str(tmp_path / "mine"), "--out", str(tmp_path / "out"), "--format", "csv"]) == 0
    rows = list(csv.DictReader(ln for ln in capsys.readouterr().out.splitlines() if "," in ln))
    assert [(r["method"], r["n"]) for r in rows] == [("FedAvg", "2"), ("FedRep", "2")]
    assert float(rows[0]["last10 mean (%)"]) == pytest.approx(55.0)
    assert float(rows[0]["last10 std (%)"]) == pytest.approx(np.std([50.0, 60.0], ddof=1), abs=1e-4)
    records = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {(r["method"], r["seed"]) for r in records if r["metric"] == "acc_last10"} == set(values)


def test_a_sweep_trial_gets_its_own_run_dir_and_the_agents_run_id(tmp_path, monkeypatch):
    """The agent sets WANDB_SWEEP_ID and WANDB_RUN_ID for each trial: the trial writes to its own run dir and logs
    into the W&B run the agent created."""
    from fl_lightning.cli import default_run_dir
    from fl_lightning.loggers import wandb_run_id

    assert default_run_dir({"config": ["configs/digits/base.yaml"]}) == Path("runs/base")
    monkeypatch.setenv("WANDB_SWEEP_ID", "sw123")
    monkeypatch.setenv("WANDB_RUN_ID", "trial9xy")
    assert default_run_dir({"config": ["configs/digits/base.yaml"]}) == Path("runs/sweep-sw123/trial9xy")
    assert wandb_run_id(tmp_path, resume=False) == "trial9xy"
    assert (tmp_path / "wandb_id").read_text().strip() == "trial9xy"
