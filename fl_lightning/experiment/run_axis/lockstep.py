"""The lockstep of the runs of one process: one thread per run, exactly one of them running at a time.

Each run is an unchanged ``train.py`` run (its own LightningCLI, Trainer, loggers, checkpoints) in its own thread.
The threads are cooperative: a thread runs only while it holds the lockstep's lock, and gives it up only where it
waits, in ``run_clients``. When every live run has handed in its round's clients, the last one to arrive trains
them all (``CohortExecutor``) and wakes the others. So the runs advance one round at a time together, their
Python never runs concurrently (no races on process-wide state, no extra CPU threads), and a run does not depend
on which other runs share its steps: its clients get the same data, generators and model as when it runs alone.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.client import Params
from fl_lightning.experiment.run_axis.cohorts import CohortExecutor, CohortRequest, replay_notes, shares_calls

if TYPE_CHECKING:
    from fl_lightning.engine.executor import Decision
    from fl_lightning.engine.module import FederatedModule

log = logging.getLogger("fl_lightning")


@dataclass
class Member:
    """A run of the job: its name, its batch key (``batching.batch_key``) and how its clients trained."""

    name: str
    key: str
    stacked_with_others: bool | None = None  #: set at its first round


class Interrupted(RuntimeError):
    """The batched job was interrupted (Ctrl-C in the main thread): raised in every run's thread, where Lightning
    stops the run as after any error (its last round checkpoint stays; the job resumes from it)."""


class Lockstep:
    """Cooperative scheduling of R run threads with a barrier at each round's client updates."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.live = 0  #: runs whose thread has not finished
        self.pending: list[CohortRequest] = []
        self.executor = CohortExecutor()
        self.stopping = False
        self.steps = 0  #: lockstep steps executed (each trains the waiting runs' clients together)
        self.logs: dict[int, TextIO] = {}  #: thread id → the file its run prints to (``activate``)
        self._active: TextIO | None = None
        self._saved: tuple[int, int, TextIO, TextIO] | None = None
        self.members: dict[int, Member] = {}  #: id(module) → the run (``join``)
        self.names: list[str] = []  #: every run of the job

    # ---- the record of what ran -----------------------------------------------------------------------------
    def join(self, module: FederatedModule, key: str, name: str, names: list[str]) -> None:
        """Run ``name`` (module ``module``, batch key ``key``) is one of the job's runs ``names``."""
        self.members[id(module)] = Member(name, key)
        self.names = list(names)

    def describe(self, module: Any) -> dict[str, Any]:
        """The job this run shared, for its ``summary.json`` and W&B config (``ran.batch``)."""
        member = self.members.get(id(module))
        stacked_with = []
        if member is not None and member.stacked_with_others:
            stacked_with = [m.name for m in self.members.values()
                            if m is not member and m.key == member.key and m.stacked_with_others]  # fmt: skip
        return {"runs": list(self.names), "stacked_with": stacked_with}

    def _request_key(self, module: FederatedModule, decision: Decision) -> str | None:
        """The key under which the run's clients train with the other runs', or None where they train alone (the
        run alone takes the loop, or its algorithm's server state cannot be shared): settled at the run's first
        round (its path is decided once, ``executor.decide``) and said then in its log."""
        member = self.members.get(id(module))
        if member is None:
            return None
        if member.stacked_with_others is None:
            member.stacked_with_others = decision.stacked and shares_calls(module)
            others = len(self.names) - 1
            how = ("in one stacked call with the job's runs of the same config" if member.stacked_with_others else
                   f"on their own ({decision.path}), in the job's lockstep")  # fmt: skip
            log.info("run axis: %s is one of a batched job of %d runs (with %d other%s); its clients train %s",
                     member.name, len(self.names), others, "" if others == 1 else "s", how)  # fmt: skip
        return member.key if member.stacked_with_others else None

    # ---- each run's console output to its own log -------------------------------------------------------------
    def activate(self) -> None:
        """Send what the calling run thread prints (Python and C level) to its log, if it has one. Called when a
        thread starts running or resumes; only one thread runs at a time, so fds 1 and 2 follow the running one."""
        log = self.logs.get(threading.get_ident())
        if log is None or log is self._active:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if self._saved is None:
            self._saved = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        self._active = log

    def restore_output(self) -> None:
        """The console again (after the last run)."""
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        out, err, sys.stdout, sys.stderr = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self._saved, self._active = None, None

    def enter(self, runs: int) -> None:
        self.live += runs

    def leave(self) -> None:
        """A run's thread ends (the caller holds the lock): the others may be waiting only for it."""
        self.live -= 1
        self._maybe_execute()
        self.lock.notify_all()

    def run_clients(
        self, module: FederatedModule, clients: list[int], round_idx: int, glob: Params, states: list[Params],
        budgets: list[float], decision: Decision,
    ) -> list[ClientUpdate]:  # fmt: skip
        """Hand in this run's clients of the round (on the path ``decision`` the run takes alone), wait for the
        step, return their updates (the calling thread holds the lock, as every run thread does while it runs)."""
        if self.stopping:
            raise Interrupted()
        request = CohortRequest(module, clients, round_idx, glob, states, budgets, self._request_key(module, decision))
        self.pending.append(request)
        self._maybe_execute()
        while not request.done:
            self.lock.wait()
            if self.stopping and not request.done:
                raise Interrupted()
        self.activate()
        replay_notes(module, request.notes)  # what the engine said while the step trained, in this run's log
        if request.error is not None:
            raise request.error
        return request.result

    def _maybe_execute(self) -> None:
        if self.pending and len(self.pending) >= self.live:
            step, self.pending = self.pending, []
            self.steps += 1
            self.executor.run(step)
            self.lock.notify_all()

    def stop(self) -> None:
        """Ctrl-C: every waiting run raises ``Interrupted`` (the running one at its next step)."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
