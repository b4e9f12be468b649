"""The run axis end to end: two runs of one job never write one run dir, and what the engine says inside a shared
step reaches every run's own log. Each module's own tests are in ``tests/experiment/run_axis/``."""

from __future__ import annotations

import json

from fl_lightning.experiment.run_axis import BatchedRuns
from fl_lightning.experiment.run_axis.__main__ import main as run_axis_main
from fl_lightning.experiment.run_axis.__main__ import seed_runs
from tests.helpers.run_axis_runs import QUICK


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
    """Two seeds batched on the stacked path with a client optimiser that has no batched form (Adagrad): the stacked
    call says it falls back once, in the thread of the run that arrived last; each run's own log holds the line once,
    with its own executor and run-axis lines, and no logging error (issue 40)."""
    adagrad = ["--model.executor", "vectorized", "--model.client_optimizer", "torch.optim.Adagrad"]
    runs = seed_runs([*QUICK, *adagrad, "--trainer.max_steps", "2", "--run_dir", str(tmp_path / "job")], [0, 1])
    logs = [tmp_path / "s0.log", tmp_path / "s1.log"]
    outcomes = BatchedRuns(runs, ["s0", "s1"], logs=logs).run()
    assert [o.status for o in outcomes] == ["done", "done"], [o.error for o in outcomes]
    for log, name in zip(logs, ["s0", "s1"]):
        text = log.read_text()
        assert text.count("vectorized executor: client optimizer Adagrad has no batched form: clients run in turn") == 1
        assert text.count("executor: stacked (model.executor: vectorized)") == 1
        assert text.count(f"run axis: {name} is one of a batched job of 2 runs") == 1
        assert "Logging error" not in text
        ran = json.loads((tmp_path / "job" / name / "summary.json").read_text())["ran"]
        assert ran == {"executor": "stacked", "reason": "model.executor: vectorized",
                       "batch": {"runs": ["s0", "s1"], "stacked_with": ["s1" if name == "s0" else "s0"]}}  # fmt: skip
