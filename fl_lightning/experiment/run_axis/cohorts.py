"""The cohorts of several runs trained as one vectorized cohort.

Run r samples its K_r clients; the R cohorts are concatenated into Σ K_r "clients" of one ``RunsContext`` (the
vectorized executor's ``VectorizedContext``): each client brings its own run's data, generator
``(run seed, round, client)``, step budget, global model (expanded from its run's) and client state, so the
stacked local updates are each run's own. The uploads and state rows are then split back per run; each run
aggregates, steps its own server optimiser and evaluates in its own Lightning loop.

Runs share one call when their identities are equal but for what the run axis carries per run (``batching``:
the batched job's runs were grouped by that key, derived from each run's resolved config) and each run alone would
train its clients on the stacked path (``executor.decide``: a run that asks for the loop, or whose ``auto`` picks
it, trains its own clients in its own loop in the lockstep). An algorithm with server state an update could read
shares a call only if that state broadcasts: then each client holds its own run's buffers for the call
(``each_runs_server_state``). An algorithm that reads ``ctx.seed`` or ``ctx.round`` while the runs differ in it
gets one call per run from then on (``MixedRunValue``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.client import Params
from fl_lightning.engine.executor import client_settings, decided, stacked_updates
from fl_lightning.engine.notes import say_once
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import own_stacked_forward, per_sample_loss_for, stack, unstack
from fl_lightning.engine.state import split_state

if TYPE_CHECKING:
    from fl_lightning.engine.module import FederatedModule

log = logging.getLogger("fl_lightning")


class MixedRunValue(RuntimeError):
    """The algorithm read a per-run value (``ctx.seed``, ``ctx.round``) of a cohort whose runs differ in it."""


class RunsContext(VectorizedContext):
    """A ``VectorizedContext`` over the clients of several runs (``run_slices``: each run's positions).

    ``seed`` and ``round`` are per run: reading them is allowed only when every run agrees. The frozen-body
    features are computed per run exactly as a run alone computes them; everything else (the phase's draws from
    each client's own generator, the stacked steps) is ``VectorizedContext``'s."""

    def __init__(
        self,
        *args: Any,
        rounds: Sequence[int],
        seeds: Sequence[int],
        run_slices: Sequence[tuple[int, int]],
        **kwargs: Any,
    ) -> None:
        self.client_rounds, self.client_seeds, self.run_slices = list(rounds), list(seeds), list(run_slices)
        super().__init__(*args, **kwargs)
        #: the cohort's global model ``[K, ...]`` as given to the algorithm: rows ``lo:hi`` are run ``lo:hi``'s own
        self.run_global: Params = {}

    def _uniform(self, name: str, values: list[int]) -> int:
        if len(set(values)) > 1:
            raise MixedRunValue(f"the algorithm reads ctx.{name}, which differs between the batched runs")
        return values[0] if values else 0

    @property
    def seed(self) -> int:  # type: ignore[override]
        return self._uniform("seed", self.client_seeds)

    @seed.setter
    def seed(self, value: int) -> None:  # set by VectorizedContext.__init__; the per-run values stay
        pass

    @property
    def round(self) -> int:  # type: ignore[override]
        return self._uniform("round", self.client_rounds)

    @round.setter
    def round(self, value: int) -> None:
        pass

    def _run_body(self, body: Params, lo: int, hi: int) -> tuple[Params, bool]:
        """Run ``lo:hi``'s rows of the body and whether its clients share them. Rows taken unchanged from the
        cohort's global model (``run_global``, set by ``run_stacked``: each run's rows are copies of its own global
        model) are shared within the run, as the engine's stride-0 global is for a run alone (found from the
        tensors' addresses and strides, without reading the device)."""
        if body and all(_same_view(v, self.run_global.get("body." + n)) for n, v in body.items()):
            return {n: v[lo].expand(hi - lo, *v.shape[1:]) for n, v in body.items()}, True
        mine = {n: v[lo:hi] for n, v in body.items()}
        return mine, all(v.stride(0) == 0 for v in mine.values())

    @torch.no_grad()
    def _features(self, params: Params) -> Tensor:
        """φ(x) of every client's training rows (``data`` order), run by run with that run's body, exactly as the
        run alone computes them (one pass over the run's rows when its clients share the body)."""
        body, _ = self._body_of(params)
        out: list[Tensor] = []
        for lo, hi in self.run_slices:
            if lo == hi:
                continue
            mine, shared = self._run_body(body, lo, hi)
            if shared:
                start, stop = self.offsets[lo], self.offsets[hi - 1] + self.sizes[hi - 1]
                out.append(self._body_pass(mine, True, self.data[0][start:stop].unsqueeze(0))[0])
            else:
                out += [self._body_rows(unstack(mine, k), self.xs[lo + k]) for k in range(hi - lo)]
        return torch.cat(out) if out else self.data[0].new_zeros(0)

    @torch.no_grad()
    def _body_pass(self, body: Params, shared: bool, x: Tensor) -> Tensor:
        """``VectorizedContext._body_pass`` run by run: ``x[lo:hi]`` with run ``lo:hi``'s body (one pass over the
        run's rows when its clients share it)."""
        if shared or not self.run_slices:
            return super()._body_pass(body, shared, x)
        out = []
        for lo, hi in self.run_slices:
            if lo < hi:
                out.append(super()._body_pass(*self._run_body(body, lo, hi), x[lo:hi]))
        return torch.cat(out)


def _same_view(a: Tensor, b: Tensor | None) -> bool:
    """Whether ``a`` is ``b`` (or a detached view of all of it): same memory, shape and strides."""
    return b is not None and a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()


@dataclass
class CohortRequest:
    """One run's clients of one round, as ``FederatedModule.run_clients`` receives them."""

    module: FederatedModule
    clients: list[int]
    round_idx: int
    glob: Params
    states: list[Params]
    budgets: list[float]
    key: str | None = None  #: the run's batch key where its clients train stacked with others, else None (alone)
    notes: list[logging.LogRecord] = field(default_factory=list)  #: what the engine said while they trained
    result: list[ClientUpdate] | None = None
    error: BaseException | None = None
    done: bool = False


def shares_calls(module: FederatedModule) -> bool:
    """Whether the run's stacked clients may train in one call with other runs' clients: its algorithm has no
    server state an update could read, or only buffers it reads in broadcasting arithmetic
    (``Algorithm.server_state_broadcasts``); never a network with its own stacked forward (``LoRAClassifier``: the
    runs' bases are separate tensors, which one call would copy per client)."""
    if own_stacked_forward(module.net) is not None:  # a LoRA network: its step multiplies by its own run's one base
        return False
    algorithm = module.algorithm
    buffers = any(True for _ in algorithm.buffers()) and not algorithm.server_state_broadcasts
    return not (any(True for _ in algorithm.parameters()) or buffers)


@contextmanager
def each_runs_server_state(requests: Sequence[CohortRequest], slices: Sequence[tuple[int, int]]) -> Iterator[None]:
    """For one stacked call, the first run's algorithm holds every server buffer per client, ``[K, ...]`` with rows
    ``lo:hi`` its run's own (``Algorithm.server_state_broadcasts``); its own buffers are put back afterwards."""
    algorithm = requests[0].module.algorithm
    names = [n for n, _ in algorithm.named_buffers()]
    if len(requests) == 1 or not names:
        yield
        return
    saved = {n: algorithm.get_buffer(n) for n in names}
    try:
        for n in names:
            per_run = [req.module.algorithm.get_buffer(n) for req in requests]
            stacked = torch.cat([b.expand(hi - lo, *b.shape) for b, (lo, hi) in zip(per_run, slices)])
            owner, _, leaf = n.rpartition(".")
            setattr(algorithm.get_submodule(owner), leaf, stacked)  # nn.Module puts a tensor under a buffer's name
        yield
    finally:
        for n, b in saved.items():
            owner, _, leaf = n.rpartition(".")
            setattr(algorithm.get_submodule(owner), leaf, b)


def run_stacked(requests: Sequence[CohortRequest]) -> list[list[ClientUpdate]]:
    """The local updates of every request's clients in one ``client_update`` call of the first run's algorithm
    (the requests share a batch key: everything but the seed is the first run's)."""
    first = requests[0].module
    xs, ys, sides, gens, budgets, rounds, seeds, clients = [], [], [], [], [], [], [], []
    globs, states, kept, slices = [], [], [], []
    has_side = first.fed.side is not None
    for req in requests:
        m, k = req.module, len(req.clients)
        slices.append((len(clients), len(clients) + k))
        clients += req.clients
        for c in req.clients:
            x, y = m.fed.train.client(c)
            xs.append(x)
            ys.append(y)
            gens.append(make_generator(m.fed.seed, "train", req.round_idx, c))
            if has_side:
                sides.append(m.fed.side[c])
        budgets += req.budgets
        rounds += [req.round_idx] * k
        seeds += [m.fed.seed] * k
        for st in req.states:
            mine, opt = split_state(st)
            states.append(mine)
            kept.append(opt)
        if k:
            globs.append({n: v.expand(k, *v.shape) for n, v in req.glob.items()})
    out: list[list[ClientUpdate]] = [[] for _ in requests]
    if not clients:
        return out
    ctx = RunsContext(
        first.net, clients, xs, ys, sides if has_side else None, client_settings(first),
        per_sample_loss_for(first.fed.num_classes), gens, first.fed.augment, rounds[0], seeds[0], budgets,
        rounds=rounds, seeds=seeds, run_slices=slices, paths=getattr(decided(first), "paths", None),  # the run's plan
    )  # fmt: skip
    keep = first.keep_client_optimizer_state
    ctx.optimizer_state = stack(kept) if keep else None
    glob = globs[0] if len(globs) == 1 else {n: torch.cat([g[n] for g in globs]) for n in globs[0]}
    ctx.run_global = glob
    with each_runs_server_state(requests, slices):
        upd = first.algorithm.client_update(ctx, glob, stack(states) if states[0] else {})
    new_kept = ctx.optimizer_state or {}
    for r, (lo, hi) in enumerate(slices):
        out[r] = stacked_updates(upd, ctx, new_kept, lo, hi)  # as executor.run_clients
    return out


@dataclass
class CohortExecutor:
    """Runs a lockstep step: groups the requests by their batch key and trains each group in one call (a request
    without a key: its run's own ``run_clients``)."""

    per_run: set = field(default_factory=set)  #: keys whose algorithm reads a per-run value (one call per run)
    calls: int = 0  #: stacked calls made (for tests and the benchmark)

    def run(self, requests: Sequence[CohortRequest]) -> None:
        groups: dict[tuple, list[CohortRequest]] = {}
        for req in requests:
            groups.setdefault(("alone", id(req.module)) if req.key is None else ("stacked", req.key), []).append(req)
        for key, group in groups.items():
            with held_notes() as notes:
                self._train(key, group)
            for req in group:  # each run says them in its own log (``Lockstep.run_clients``)
                req.notes, req.done = list(notes), True

    def _train(self, key: tuple, group: list[CohortRequest]) -> None:
        """One group's clients: their runs' own ``run_clients`` (``alone``), or stacked in one call (one per run
        once the algorithm has read a per-run value); an error fails every run of the group."""
        try:
            if key[0] == "alone":
                for req in group:
                    req.result = _alone(req)
            elif key in self.per_run:
                for req in group:
                    req.result = run_stacked([req])[0]
                    self.calls += 1
            else:
                try:
                    results = run_stacked(group)
                    self.calls += 1
                except MixedRunValue as exc:
                    log.warning("run axis: %s; its runs train one call each", exc)
                    self.per_run.add(key)
                    results = [run_stacked([req])[0] for req in group]
                    self.calls += len(group)
                for req, result in zip(group, results):
                    req.result = result
        except Exception as exc:  # every run of the group fails with the error
            for req in group:
                req.error = exc


@contextmanager
def held_notes() -> Iterator[list[logging.LogRecord]]:
    """The engine's log records (``fl_lightning`` and below) of the block, held instead of printed: a lockstep
    step trains in the thread of the run that arrived last, whose log is the one open, so each run says them in its
    own log afterwards (``replay_notes``)."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if not (record.name == "fl_lightning" or record.name.startswith("fl_lightning.")):
            return True
        if not any(r is record for r in held):  # one record passes every handler's filter
            held.append(record)
        return False

    handlers = list(logging.getLogger("fl_lightning").handlers)
    for h in handlers:
        h.addFilter(hold)
    try:
        yield held
    finally:
        for h in handlers:
            h.removeFilter(hold)


def replay_notes(module: FederatedModule, notes: Sequence[logging.LogRecord]) -> None:
    """``notes`` said in the calling run's log, each once per run (``engine.notes.say_once``)."""
    for record in notes:
        message = record.getMessage()
        say_once(module.net, "note: " + message, record.levelno, "%s", message)


def _alone(req: CohortRequest) -> list[ClientUpdate]:
    """A run whose clients train on their own: its own ``run_clients``, on the path it takes alone."""
    module, axis = req.module, req.module.run_axis
    module.run_axis = None
    try:
        return module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)
    finally:
        module.run_axis = axis
