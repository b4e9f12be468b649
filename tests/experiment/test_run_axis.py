"""The run axis end to end: two runs of one job never write one run dir, and what the engine says inside a shared
step reaches every run's own log. Each module's own tests are in ``tests/experiment/run_axis/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fl_lightning.experiment.run_axis import BatchedRuns
from fl_lightning.experiment.run_axis.__main__ import main as run_axis_main
from fl_lightning.experiment.run_axis.__main__ import seed_runs
from tests.helpers.experiment_files import tree
from tests.helpers.run_axis_runs import QUICK

ROOT = Path(__file__).resolve().parents[2]


def test_two_runs_of_one_job_never_write_one_run_dir(tmp_path, capsys):
    """``--seeds 0,0`` and a ``--runs`` file whose runs name one ``--run_dir`` are refused in one line before
    anything is written (issue 45: two threads once wrote one run dir)."""
    assert run_axis_main([*QUICK, "--run_dir", str(tmp_path / "job"), "--seeds", "0,1,0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --seeds 0,1,0: seed 0 is given twice (each seed is one run with its own run dir "
                   "<run_dir>/s<seed>); give each seed once"]  # fmt: skip
    runs = tmp_path / "runs.json"
    same = str(tmp_path / "one")
    runs.write_text(json.dumps([[*QUICK, "--run_dir", same], [*QUICK, "--seed_everything", "1", f"--run_dir={same}"]]))
    assert run_axis_main(["--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run 1 and run 0 both write run_dir {same}: give each run its own --run_dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.json"]


def test_what_the_engine_says_inside_a_shared_step_is_in_every_runs_log(tmp_path):
    SGD = "in turn: client optimizer Adagrad has no batched form"
    LINE = f"executor: stacked (sgd: {SGD}; eval: shared body) because model.executor: vectorized"
    """Two seeds batched on the stacked path with a client optimiser that has no batched form (Adagrad): each run's
    own log holds its executor line once, naming the sub-path (its clients in turn, and why; issue 41: the stacked
    call itself says nothing), with its run-axis line and no logging error (issue 40); ``summary.json``'s ``ran``
    records the same."""
    adagrad = ["--model.executor", "vectorized", "--model.client_optimizer", "torch.optim.Adagrad"]
    runs = seed_runs([*QUICK, *adagrad, "--trainer.max_steps", "2", "--run_dir", str(tmp_path / "job")], [0, 1])
    logs = [tmp_path / "s0.log", tmp_path / "s1.log"]
    outcomes = BatchedRuns(runs, ["s0", "s1"], logs=logs).run()
    assert [o.status for o in outcomes] == ["done", "done"], [o.error for o in outcomes]
    for log, name in zip(logs, ["s0", "s1"]):
        text = log.read_text()
        assert text.count("vectorized executor:") == 0  # the stacked call says nothing: the run's line names it
        assert text.count(LINE) == 1, text[-2000:]
        assert text.count(f"run axis: {name} is one of a batched job of 2 runs") == 1
        assert "Logging error" not in text
        ran = json.loads((tmp_path / "job" / name / "summary.json").read_text())["ran"]
        assert ran == {"executor": "stacked", "reason": "model.executor: vectorized", "sgd": SGD, "eval": "shared body",
                       "finetune": None,
                       "batch": {"runs": ["s0", "s1"], "stacked_with": ["s1" if name == "s0" else "s0"]}}  # fmt: skip


# ---- a refused job changes nothing, anywhere (issue 45) ------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory) -> Path:
    """A finished one-round batched job: ``<folder>/job/s0`` holds a finished run (W&B off)."""
    folder = tmp_path_factory.mktemp("finished_job")
    args = [*QUICK, "--trainer.max_steps", "1", "--wandb.mode", "disabled", "--run_dir", str(folder / "job")]
    assert run_axis_main([*args, "--seeds", "0"]) == 0
    assert (folder / "job" / "s0" / "summary.json").is_file()
    return folder / "job"


FEDAVG = ["--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/fedavg.yaml")]
#: refusals of ``python -m fl_lightning.experiment.run_axis``: name -> (arguments, what the one line says). ``JOB`` is
#: the finished job's folder (``JOB/s0`` its finished run), ``NEW`` a folder no run wrote, ``RUNS:`` a ``--runs``
#: file with this JSON text.
AXIS_REFUSALS = {
    "unknown key": ([*QUICK, "--model.nope", "1", "--run_dir", "NEW", "--seeds", "0,1"], "unrecognized arguments"),
    "value of the wrong type": ([*QUICK, "--model.lr", "abc", "--run_dir", "NEW", "--seeds", "0,1"], "model.lr"),
    "out-of-range value": ([*QUICK, "--model.lr", "-1", "--run_dir", "NEW", "--seeds", "0,1"], "must be positive"),
    "missing config file": (["--config", "NEW/nope.yaml", "--seeds", "0"], "does not exist"),
    "seed given twice": ([*QUICK, "--run_dir", "NEW", "--seeds", "0,0"], "seed 0 is given twice"),
    "--runs file missing": (["--runs", "NEW/runs.json"], "no such file"),
    "--runs file not JSON": (["--runs", "RUNS:[[1,"], "not JSON"),
    "--runs file not a list of argument lists": (["--runs", 'RUNS:{"a": 1}'], "expected a JSON list"),
    "runs that cannot share a batch": (
        ["--runs", "RUNS:" + json.dumps([FEDAVG, [*FEDAVG, "--model.lr", "0.5"]])], "cannot share a batch"),
    "a run dir holding a finished run": ([*QUICK, "--run_dir", "JOB", "--seeds", "0,1"], "holds a finished run"),
    "a resume with another learning rate, in the finished run's dir": (
        [*QUICK, "--run_dir", "JOB", "--seeds", "0", "--ckpt_path", "last", "--model.lr", "0.05"],
        "was trained with other settings"),
    "GPU asked on a CPU": ([*QUICK, "--run_dir", "NEW", "--seeds", "0,1", "--trainer.accelerator", "gpu"],
                           "trainer.accelerator gpu"),
    "data that cannot be split": (
        [*QUICK, "--run_dir", "NEW", "--seeds", "0,1", "--data.init_args.num_clients", "200",
         "--data.init_args.partition.init_args.classes_per_client", "10"], "too few to fill"),
    "--overwrite of the finished run, GPU asked": (
        [*QUICK, "--run_dir", "JOB", "--seeds", "0", "--overwrite", "true", "--trainer.accelerator", "gpu"],
        "trainer.accelerator gpu"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(AXIS_REFUSALS))
def test_a_refused_job_leaves_every_file_tree_byte_identical(case, finished_job, tmp_path, capsys, monkeypatch):
    """Each refusal is one line and exit code 2, before any run writes: no run dir, no W&B run (offline, as a user
    without an account has it), nothing in the finished run's dir; the run dir checks (``check_run_dirs``) refuse
    the whole job before its first run starts, and a refusal that every run meets once its data or trainer is built
    (the runs share their config but for the seed) is said once."""
    if "GPU" in case and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args, expected = AXIS_REFUSALS[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    given = []
    for a in args:
        if a.startswith("RUNS:"):
            (tmp_path / "runs.json").write_text(a[len("RUNS:"):])
            a = str(tmp_path / "runs.json")
        given.append(a.replace("NEW", str(tmp_path / "new")).replace("JOB", str(finished_job)))
    before = (tree(tmp_path), tree(finished_job.parent))
    code = run_axis_main(given)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (code, err)
    assert "[failed]" not in out and "Traceback" not in out + err
    assert (tree(tmp_path), tree(finished_job.parent)) == before
