"""``--jobs auto`` (``fl_lightning.experiment.gpu_share``): the number of jobs at once from the memory a first job
measured, and the runner running one job first, then that many."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from fl_lightning.experiment import gpu_share, runner
from fl_lightning.experiment.gpu_share import JobLimit, jobs_that_fit, measured_peak_mb
from fl_lightning.experiment.spec import ExperimentError, load_experiment

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits")


def test_jobs_that_fit_divide_nine_tenths_of_each_card_by_the_peak():
    assert jobs_that_fit(80_000, 7_000, gpus=1, most=64) == 10  # ⌊72,000 / 7,000⌋
    assert jobs_that_fit(80_000, 7_000, gpus=2, most=64) == 20
    assert jobs_that_fit(80_000, 7_000, gpus=2, most=16) == 16  # no more than the CPU cores
    assert jobs_that_fit(1_000, 5_000, gpus=1, most=16) == 1  # a job larger than the card still runs, alone
    assert jobs_that_fit(1_000, 300, gpus=1, most=16) == 3


def test_the_measured_peak_is_the_largest_a_jobs_runs_recorded(tmp_path):
    dirs = [tmp_path / f"s{i}" for i in range(3)]
    for d, summary in zip(dirs, [{"peak_device_mb": 120.5}, {"final": 0.5}, {"peak_device_mb": 99}]):
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(summary))
    assert measured_peak_mb(dirs) == 120.5
    assert measured_peak_mb([dirs[1], tmp_path / "missing"]) is None


def test_a_number_is_a_fixed_limit_and_auto_without_cuda_runs_in_process(monkeypatch):
    fixed = JobLimit(3)
    assert (fixed.limit, fixed.most, fixed.in_process, fixed.learn([])) == (3, 3, False, None)
    assert JobLimit(1).in_process
    monkeypatch.setattr(gpu_share, "card_memory_mb", lambda: (0.0, 0))
    assert JobLimit("auto").in_process


def test_the_runner_runs_one_job_then_as_many_as_its_measured_memory_allows(tmp_path, monkeypatch):
    """A GPU of 1,000 MiB (faked) and jobs that peak at 300 MiB (each fake job writes that into its summary):
    the first job runs alone, the other five 3 at a time (⌊0.9 · 1,000 / 300⌋), said once."""
    monkeypatch.setattr(gpu_share, "card_memory_mb", lambda: (1000.0, 1))
    monkeypatch.setattr(gpu_share.os, "cpu_count", lambda: 8)
    lock, running, seen = threading.Lock(), [0], []

    def fake_run(self, args: list[str], log_path: Path, command=None) -> tuple[str, str]:
        with lock:
            running[0] += 1
            seen.append(running[0])
        time.sleep(0.3)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        (log_path.parent / "summary.json").write_text(json.dumps({"peak_device_mb": 300.0, "rounds": 1}))
        with lock:
            running[0] -= 1
        return "done", ""

    monkeypatch.setattr(runner.Workers, "run", fake_run)
    data = {"name": "share", "configs": [f"{DIGITS}/base.yaml"],
            "axes": {"method": {"fedavg": f"{DIGITS}/fedavg.yaml"}, "seed": [0, 1, 2, 3, 4, 5]},
            "set": {"trainer.max_steps": 1}, "wandb": {"mode": "disabled"}}  # fmt: skip
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    experiment = load_experiment(path, runs_dir=tmp_path / "runs")
    runs = experiment.runs([])
    stream = io.StringIO()
    outcomes = runner.execute(experiment, runs, {}, jobs="auto", stream=stream, batch_runs=1)
    assert [o.status for o in outcomes] == ["done"] * 6
    assert seen[0] == 1 and max(seen) == 3, seen  # alone first, then never more than 3
    said = [line for line in stream.getvalue().splitlines() if line.startswith("[jobs]")]
    assert said == ["[jobs] 3 at once: a job peaked at 300 MiB of the GPU's 1000 MiB (1 GPU(s), 90% of each, "
                    "at most 8)"]


def test_jobs_that_is_neither_a_number_nor_auto_is_refused(tmp_path):
    from fl_lightning.experiment.runner import run_experiment

    data = {"name": "x", "configs": [f"{DIGITS}/base.yaml"], "axes": {"method": {"fedavg": f"{DIGITS}/fedavg.yaml"}}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ExperimentError, match="--jobs 0: expected ≥ 1, or auto"):
        run_experiment(load_experiment(path, runs_dir=tmp_path / "runs"), jobs=0)
