"""``benchmarks.batched_runs``'s CPU split: ``cpu_parts`` charges the CPU time spent inside the engine's client
training and evaluation to those parts (per thread: a thread that waits uses none), and puts the functions back."""

from __future__ import annotations

import threading
import time

from benchmarks import batched_runs
from fl_lightning.engine import evaluation, executor


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
    assert set(spent) == {"client training", "client evaluation"}
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
