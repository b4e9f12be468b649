"""The cohorts of several runs trained as one vectorized cohort.

Run r samples its K_r clients; the R cohorts are concatenated into Σ K_r "clients" of one ``RunsContext`` (the
vectorized executor's ``VectorizedContext``): each client brings its own run's data, generator
``(run seed, round, client)``, step budget, global model (expanded from its run's) and client state, so the
stacked local updates are each run's own. The uploads and state rows are then split back per run; each run
aggregates, steps its own server optimiser and evaluates in its own Lightning loop.

Runs share one call when everything the call holds once is the same for them (``cohort_key``): the algorithm's
class and hyper-parameters (and no server state an update could read, unless it broadcasts: then each client holds
its own run's buffers for the call, ``each_runs_server_state``), the network's structure, the client
optimiser of the round, the loss, the augmentation and whether optimiser state is kept. Others train in their
own call of the same lockstep step. An algorithm that reads ``ctx.seed`` or ``ctx.round`` while the runs differ
in it gets one call per run from then on (``MixedRunValue``).
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
from fl_lightning.client import Params, factory_name, split_state
from fl_lightning.engine.executor import Workload, choose_path, stacked_updates
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.stacked import VectorizedContext, per_sample_loss_for, stack, unstack

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
    result: list[ClientUpdate] | None = None
    error: BaseException | None = None
    done: bool = False


def combinable(module: FederatedModule) -> bool:
    """Whether the run's local update runs on stacked clients (else it runs its own loop in the lockstep): the
    stacked path can run it (``executor.choose_path`` asked for ``vectorized``: whether it wins does not depend on
    one run's cohort, the runs' cohorts train together) and the algorithm has no server state an update could read,
    or only buffers that it reads in broadcasting arithmetic (``Algorithm.server_state_broadcasts``)."""
    algorithm = module.algorithm
    buffers = any(True for _ in algorithm.buffers()) and not algorithm.server_state_broadcasts
    server_state = any(True for _ in algorithm.parameters()) or buffers
    can = choose_path(algorithm, module.net, module.device, Workload(clients=1), "vectorized").stacked
    return can and not server_state


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
            algorithm.get_submodule(owner)._buffers[leaf] = stacked
        yield
    finally:
        for n, b in saved.items():
            owner, _, leaf = n.rpartition(".")
            algorithm.get_submodule(owner)._buffers[leaf] = b


_SKIP = ("training", "num_aggregated")


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_plain(v) for v in value]
        return tuple(sorted(items, key=repr)) if isinstance(value, (set, frozenset)) else tuple(items)
    return repr(value)  # an object without a value-like repr keeps its address: never equal across runs


def cohort_key(module: FederatedModule) -> tuple:
    """What must agree for runs to share one stacked call (see the module docstring)."""
    if not combinable(module):
        return ("alone", id(module))
    algorithm, net, fed = module.algorithm, module.net, module.fed
    settings = module.round_optimizers.client_settings()
    hyper = tuple(sorted((k, _plain(v)) for k, v in vars(algorithm).items() if k[0] != "_" and k not in _SKIP))
    structure = (
        type(net),
        repr(net),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in net.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in net.named_buffers()),
    )
    optimizer = (
        settings.lr, settings.momentum, settings.weight_decay, settings.batch_size, settings.decay_bias,
        factory_name(settings.factory), _optimizer_defaults(module),
    )  # fmt: skip
    augment = None if fed.augment is None else (type(fed.augment), _plain(sorted(vars(fed.augment).items())))
    return (
        type(algorithm), hyper, structure, optimizer, module.keep_client_optimizer_state, fed.num_classes is None,
        augment, fed.side is None, str(fed.train.y.device),
    )  # fmt: skip


def _optimizer_defaults(module: FederatedModule) -> tuple:
    cached = getattr(module, "_run_axis_optimizer_defaults", None)
    if cached is None:
        probe = module.round_optimizers.client.probe()
        cached = tuple(sorted((k, _plain(v)) for k, v in probe.defaults.items() if k != "lr"))
        module._run_axis_optimizer_defaults = cached
    return cached


def run_stacked(requests: Sequence[CohortRequest]) -> list[list[ClientUpdate]]:
    """The local updates of every request's clients in one ``client_update`` call of the first run's algorithm
    (the requests share a ``cohort_key``)."""
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
        first.net, clients, xs, ys, sides if has_side else None, first.round_optimizers.client_settings(),
        per_sample_loss_for(first.fed.num_classes), gens, first.fed.augment, rounds[0], seeds[0], budgets,
        rounds=rounds, seeds=seeds, run_slices=slices,
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
    """Runs a lockstep step: groups the requests by ``cohort_key`` and trains each group in one call."""

    per_run: set = field(default_factory=set)  #: keys whose algorithm reads a per-run value (one call per run)
    calls: int = 0  #: stacked calls made (for tests and the benchmark)

    def run(self, requests: Sequence[CohortRequest]) -> None:
        groups: dict[tuple, list[CohortRequest]] = {}
        for req in requests:
            groups.setdefault(cohort_key(req.module), []).append(req)
        for key, group in groups.items():
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
            for req in group:
                req.done = True


def _alone(req: CohortRequest) -> list[ClientUpdate]:
    """A run whose update cannot be stacked: its own ``run_clients`` (sequential or vectorized)."""
    module, axis = req.module, req.module.run_axis
    module.run_axis = None
    try:
        return module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)
    finally:
        module.run_axis = axis
