"""``benchmarks.batched_runs``'s CPU split: ``cpu_parts`` charges the CPU time spent inside the engine's client
training and evaluation to those parts (per thread: a thread that waits uses none), and puts the functions back."""

from __future__ import annotations

import threading
import time

from benchmarks import batched_runs
from fl_lightning.engine import evaluation, executor
from fl_lightning.results import record


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_parts_charges_each_part_its_own_cpu_time_and_restores_the_functions(monkeypatch) -> None:
    def wait_for_another_thread(seconds: float) -> None:  # as a run thread waiting at the lockstep
        worker = threading.Thread(target=burn, args=(seconds,))
        worker.start()
        worker.join()

    monkeypatch.setattr(executor, "run_clients", lambda seconds: burn(seconds))
    monkeypatch.setattr(evaluation, "evaluate_clients", wait_for_another_thread)
    training, scoring = executor.run_clients, evaluation.evaluate_clients
    with batched_runs.cpu_parts() as spent:
        executor.run_clients(0.15)
        other_run = threading.Thread(target=executor.run_clients, args=(0.1,))  # another run's thread trains
        other_run.start()
        evaluation.evaluate_clients(0.2)  # this thread waits: the other threads' CPU is not charged to it
        other_run.join()
    assert set(spent) == {part for _, _, part in batched_runs.PARTS}
    assert {"client training", "client evaluation", "self.log", "checkpoints"} <= set(spent)
    assert 0.25 <= spent["client training"] < 0.4
    assert spent["client evaluation"] < 0.05
    assert executor.run_clients is training and evaluation.evaluate_clients is scoring


def test_cpu_parts_counts_a_call_that_raises() -> None:
    def failing(seconds: float) -> None:
        burn(seconds)
        raise ValueError("bad client")

    saved = executor.run_clients
    executor.run_clients = failing
    try:
        with batched_runs.cpu_parts() as spent:
            try:
                executor.run_clients(0.05)
            except ValueError:
                pass
    finally:
        executor.run_clients = saved
    assert spent["client training"] >= 0.05


def test_cpu_parts_charges_a_method_of_a_class_and_puts_it_back(monkeypatch) -> None:
    from fl_lightning.engine.module import FederatedModule

    monkeypatch.setattr(FederatedModule, "_server_step", lambda self, seconds: burn(seconds))
    server_step = FederatedModule.__dict__["_server_step"]
    with batched_runs.cpu_parts() as spent:
        FederatedModule._server_step(None, 0.1)  # as a run's training_step calls it
    assert 0.1 <= spent["aggregation and server step"] < 0.2
    assert spent["client training"] == spent["self.log"] == 0.0
    assert FederatedModule.__dict__["_server_step"] is server_step


def test_plot_cpu_draws_one_panel_per_measured_workload_with_each_sides_parts(tmp_path, monkeypatch) -> None:
    records = [
        record("table1_digits", "sequential", "cpu_s:client training", 30.0),
        record("table1_digits", "sequential", "cpu_s:everything else", 10.0),
        record("table1_digits", "default command", "cpu_s:client training", 6.0),
        record("table1_digits", "default command", "cpu_s:everything else", 4.0),
        record("run_axis", "sequential x5", "cpu_s", 50.0, setting="digits_fedrep,seeds=5"),
        record("run_axis", "batched x5", "cpu_s", 10.0, setting="digits_fedrep,seeds=5"),
        record("run_axis", "design", "design_gflop_per_run", 1.0, setting="design,CIFAR-10"),
    ]
    import matplotlib.pyplot as plt

    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its bars
    path = batched_runs.plot_cpu(records, tmp_path / "cpu.png")
    assert path == tmp_path / "cpu.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert set(panels) == {"table1_digits", "digits_fedrep"}  # nothing from the design arithmetic
    bars = {title: sorted((round(p.get_x() + p.get_width() / 2), p.get_y(), p.get_height()) for p in ax.patches)
            for title, ax in panels.items()}  # fmt: skip
    # each side a bar, its parts stacked: (position, bottom, height)
    assert bars["table1_digits"] == [(0, 0.0, 30.0), (0, 30.0, 10.0), (1, 0.0, 6.0), (1, 6.0, 4.0)]
    assert bars["digits_fedrep"] == [(0, 0.0, 50.0), (1, 0.0, 10.0)]
    speedups = {title: [t.get_text() for t in ax.texts] for title, ax in panels.items()}
    assert speedups == {"table1_digits": ["1.00x", "4.00x"], "digits_fedrep": ["1.00x", "5.00x"]}


def test_plot_cpu_writes_nothing_without_a_measurement(tmp_path) -> None:
    design = [record("run_axis", "design", "design_steps_per_run", 3.0, setting="design,CIFAR-10")]
    assert batched_runs.plot_cpu(design, tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()


def test_results_json_is_written_as_the_workloads_go(tmp_path, monkeypatch) -> None:
    """A workload that fails late keeps the records of the workloads measured before it in results.json."""
    import json

    import pytest

    def measured(args, records, rows) -> None:
        records.append(record("run_axis", "batched x2", "wall_s", 1.5, setting="first"))

    def failing(args, records, rows) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(batched_runs, "WORKLOADS", {"measured": measured, "failing": failing})
    with pytest.raises(RuntimeError, match="out of memory"):
        batched_runs.main(["--out", str(tmp_path), "--workloads", "measured", "failing"])
    records = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["metric"], r["value"]) for r in records] == [("batched x2", "wall_s", 1.5)]


def test_print_parts_gives_each_sides_shared_work_per_run_round(capsys) -> None:
    """Everything but client training and evaluation, divided by runs × rounds, in ms (issue 42's figure)."""
    parts = {
        "sequential, one at a time": {"client training": 8.0, "client evaluation": 2.0, "self.log": 1.0,
                                      "everything else": 3.0},
        "default command": {"client training": 1.0, "client evaluation": 1.0, "self.log": 0.5,
                            "everything else": 1.5},
    }  # fmt: skip
    records: list = []
    batched_runs.print_parts("grid", parts, records, "grid,setting", run_rounds=200)
    out = capsys.readouterr().out
    assert "sequential 20.00 ms, default 10.00 ms" in out  # (1 + 3) s / 200, (0.5 + 1.5) s / 200
    shared = {r["method"]: r["value"] for r in records if r["metric"] == "shared_ms_per_run_round"}
    assert shared == {"sequential": 20.0, "default command": 10.0}
    assert "ceiling" in out and "shared work" not in capsys.readouterr().out  # printed once


def test_parts_charge_the_modules_one_logging_call() -> None:
    """``self.log`` is the module's ``log_scalars`` (one call per round and evaluation), not Lightning's per-key
    ``log``, which ``log_scalars`` no longer calls (no part calls another)."""
    assert ("fl_lightning.engine.module", "FederatedModule.log_scalars", "self.log") in batched_runs.PARTS
    assert not any(path == "LightningModule.log" for _, path, _ in batched_runs.PARTS)


def test_exclusive_times_charge_each_call_its_own_time_less_the_timed_calls_inside() -> None:
    """A fake clock that advances 1 s per read: outer reads the clock at its start and end (2 s elapsed around
    inner's 1 s) and inner is called twice, so outer's own time is its elapsed time less inner's."""
    ticks = iter(range(100))
    times = batched_runs.ExclusiveTimes(clock=lambda: float(next(ticks)))

    def inner() -> None:
        pass

    timed_inner = times.wrap(inner, "inner")

    def outer() -> None:
        timed_inner()
        timed_inner()

    times.wrap(outer, "outer")()
    # reads: outer start 0, inner 1→2, inner 3→4, outer end 5: outer 5 − 0 − (1 + 1) = 3, inner 1 + 1 = 2
    assert times.spent == {"inner": 2.0, "outer": 3.0}


def test_exclusive_parts_wraps_and_restores_a_method_and_counts_a_call_that_raises(monkeypatch) -> None:
    class Worker:
        def work(self, fail: bool) -> int:
            if fail:
                raise ValueError("x")
            return 7

    original = Worker.__dict__["work"]
    monkeypatch.setattr(batched_runs, "Worker", Worker, raising=False)
    clock = iter(range(100))
    parts = (("benchmarks.batched_runs", "Worker.work", "work"),)
    with batched_runs.exclusive_parts(parts, clock=lambda: float(next(clock))) as spent:
        assert Worker().work(False) == 7
        try:
            Worker().work(True)
        except ValueError:
            pass
    assert spent == {"work": 2.0}  # two calls of one tick each, the raising one included
    assert Worker.__dict__["work"] is original
