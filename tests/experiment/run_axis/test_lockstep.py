"""``fl_lightning/experiment/run_axis/lockstep.py``: the barrier of the runs' threads at each round's clients (the
last run to arrive trains every waiting run's clients in one step), a run that ends releasing the others, Ctrl-C,
and the record of which runs shared their stacked calls, with a stand-in executor and stand-in runs."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
from torch import nn

from fl_lightning.experiment.run_axis.lockstep import Interrupted, Lockstep


class Steps:
    """Records each step's runs and answers every request with its run's name and round."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def run(self, requests) -> None:
        self.steps.append(sorted(r.module.name for r in requests))
        for r in requests:
            r.result, r.done = [f"{r.module.name}@{r.round_idx}"], True


def run(name: str, shares: bool = True) -> SimpleNamespace:
    algorithm = nn.Module()
    if not shares:  # a server parameter: its clients cannot share a call with another run's
        algorithm.c = nn.Parameter(nn.init.zeros_(nn.Linear(1, 1).weight))
    algorithm.server_state_broadcasts = False
    return SimpleNamespace(name=name, algorithm=algorithm, net=nn.Linear(2, 2))  # no own stacked forward


STACKED = SimpleNamespace(stacked=True, path="stacked")


def _threads(lockstep: Lockstep, plans: dict[str, list[int]]) -> dict[str, list]:
    """Each run's thread hands in one request per round of its plan, holding the lock as run threads do."""
    got: dict[str, list] = {name: [] for name in plans}
    modules = {name: run(name) for name in plans}
    lockstep.enter(len(plans))

    def body(name: str) -> None:
        with lockstep.lock:
            try:
                for r in plans[name]:
                    got[name].append(lockstep.run_clients(modules[name], [0], r, {}, [{}], [1.0], STACKED))
            except Interrupted:
                got[name].append("interrupted")
            finally:
                lockstep.leave()

    threads = [threading.Thread(target=body, args=(n,)) for n in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return got


def test_every_round_is_one_step_of_all_live_runs_and_a_finished_run_releases_the_others() -> None:
    lockstep = Lockstep()
    lockstep.executor = Steps()
    got = _threads(lockstep, {"a": [0, 1, 2], "b": [0, 1], "c": [0, 1, 2]})
    assert lockstep.executor.steps == [["a", "b", "c"], ["a", "b", "c"], ["a", "c"]]  # b ended after round 1
    assert lockstep.steps == 3
    assert got == {"a": [["a@0"], ["a@1"], ["a@2"]], "b": [["b@0"], ["b@1"]], "c": [["c@0"], ["c@1"], ["c@2"]]}


def test_a_stopped_job_raises_interrupted_in_every_waiting_run() -> None:
    lockstep = Lockstep()
    lockstep.executor = Steps()
    lockstep.stop()
    got = _threads(lockstep, {"a": [0], "b": [0]})
    assert got == {"a": ["interrupted"], "b": ["interrupted"]} and lockstep.executor.steps == []


def test_the_record_names_the_runs_that_shared_stacked_calls(caplog: pytest.LogCaptureFixture) -> None:
    lockstep = Lockstep()
    names = ["s0", "s1", "lr", "scaffold"]
    modules = {"s0": run("s0"), "s1": run("s1"), "lr": run("lr"), "scaffold": run("scaffold", shares=False)}
    keys = {"s0": "k", "s1": "k", "lr": "other lr", "scaffold": "k"}
    for name, module in modules.items():
        lockstep.join(module, keys[name], name, names)
    with caplog.at_level(logging.INFO, logger="fl_lightning"):
        for module in modules.values():
            lockstep._request_key(module, STACKED)
        lockstep._request_key(modules["s0"], STACKED)  # settled at the first round: said once
    assert lockstep.describe(modules["s0"]) == {"runs": names, "stacked_with": ["s1"]}
    assert lockstep.describe(modules["lr"]) == {"runs": names, "stacked_with": []}  # its own key: alone
    assert lockstep.describe(modules["scaffold"]) == {"runs": names, "stacked_with": []}  # server state: its own
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run axis: ")]
    assert len(said) == 4 and said[0] == ("run axis: s0 is one of a batched job of 4 runs (with 3 others); its "
                                          "clients train in one stacked call with the job's runs of the same config")
    assert said[3].endswith("its clients train on their own (stacked), in the job's lockstep")
    assert lockstep.describe(run("stranger")) == {"runs": names, "stacked_with": []}
