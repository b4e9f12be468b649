"""The cohorts of several runs trained as one vectorized cohort.

Run r samples its K_r clients; the R cohorts are concatenated into Σ K_r "clients" of one ``RunsContext`` (the
vectorized executor's ``VectorizedContext``): each client brings its own run's data, generator
``(run seed, round, client)``, step budget, global model (expanded from its run's) and client state, so the
stacked local updates are each run's own. The uploads and state rows are then split back per run; each run
aggregates, steps its own server optimiser and evaluates in its own Lightning loop.

Runs share one call when everything the call holds once is the same for them (``cohort_key``): the algorithm's
class and hyper-parameters (and no server state an update could read), the network's structure, the client
optimiser of the round, the loss, the augmentation and whether optimiser state is kept. Others train in their
own call of the same lockstep step. An algorithm that reads ``ctx.seed`` or ``ctx.round`` while the runs differ
in it gets one call per run from then on (``MixedRunValue``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.executors import VectorizedContext, has_batchnorm, per_sample_loss_for, stack, unstack
from fl_lightning.local import Params, factory_name, split_state
from fl_lightning.rounds import make_generator

if TYPE_CHECKING:
    from fl_lightning.module import FederatedModule

log = logging.getLogger("fl_lightning")


class MixedRunValue(RuntimeError):
    """The algorithm read a per-run value (``ctx.seed``, ``ctx.round``) of a cohort whose runs differ in it."""


class RunsContext(VectorizedContext):
    """A ``VectorizedContext`` over the clients of several runs (``run_slices``: each run's positions).

    ``seed`` and ``round`` are per run: reading them is allowed only when every run agrees. The frozen-body
    features are computed per run exactly as a run alone computes them, and an epoch's padded minibatches are
    gathered with one index operation (the same permutations, from the same generators, as the loop)."""

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
        self._stacked: tuple[list[Tensor], Tensor, Tensor] | None = None

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

    def _features(self, params: Params) -> list[Tensor]:
        """φ(x) per run, each with that run's body, exactly as the run alone computes it."""
        out: list[Tensor] = []
        for lo, hi in self.run_slices:
            if lo == hi:
                continue
            part = VectorizedContext(
                self.net, self.clients[lo:hi], self.xs[lo:hi], self.ys[lo:hi], None, self.optimizer,
                self.per_sample_loss, self.generators[lo:hi], None, 0, 0, self.step_budgets[lo:hi],
            )  # fmt: skip
            out += part._features({n: v[lo:hi] for n, v in params.items()})
        self.feature_passes += 1
        return out

    def _epoch_batches(
        self, inputs: Sequence[Tensor], remaining: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``VectorizedContext._epoch_batches`` without a Python loop over batches (augmentation, drawn batch by
        batch from the client's generator, keeps the loop): same permutations, same padded tensors."""
        if self.augment is not None and inputs is self.xs:
            return super()._epoch_batches(inputs, remaining)
        bs, k = self.optimizer.batch_size, self.num_clients
        sizes = [x.shape[0] for x in inputs]
        num_batches = [min(-(-n // bs), r) for n, r in zip(sizes, remaining)]
        b_max = max(num_batches)
        if self._stacked is None or self._stacked[0] is not inputs:
            flat = torch.cat([*inputs, inputs[0].new_zeros(1, *inputs[0].shape[1:])])  # last row: padding
            labels = torch.cat([*self.ys, self.ys[0].new_zeros(1)])  # features keep the rows of xs
            self._stacked = (inputs, flat, labels)
        _, flat, labels = self._stacked
        device = flat.device
        takes, offset = [], 0
        for n, nb, g in zip(sizes, num_batches, self.generators):
            if nb > 0:
                perm = torch.randperm(n, generator=g)
                takes.append(perm[: min(n, nb * bs)] + offset)
            else:
                takes.append(torch.zeros(0, dtype=torch.long))
            offset += n
        lengths = torch.tensor([len(t) for t in takes])
        source = torch.cat(takes)
        first = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        slot = torch.arange(len(source)) - first + torch.repeat_interleave(torch.arange(k) * (b_max * bs), lengths)
        index = torch.full((k * b_max * bs,), offset, dtype=torch.long)  # ``offset`` is the padding row
        index[slot] = source
        index = index.to(device)
        x_out = flat[index].view(k, b_max, bs, *flat.shape[1:])
        y_out = labels[index].view(k, b_max, bs)
        mask = (index != offset).view(k, b_max, bs).to(torch.get_default_dtype())
        active = torch.arange(b_max, device=device)[None, :] < torch.tensor(num_batches, device=device)[:, None]
        return x_out, y_out, mask, active


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
    """Whether the run's local update runs on stacked clients (else it runs its own loop in the lockstep)."""
    algorithm = module.algorithm
    server_state = any(True for _ in algorithm.parameters()) or any(True for _ in algorithm.buffers())
    return (
        bool(type(algorithm).__dict__.get("vectorizable", False)) and not has_batchnorm(module.net) and not server_state
    )


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
    upd = first.algorithm.client_update(ctx, glob, stack(states) if states[0] else {})
    new_kept = ctx.optimizer_state or {}
    num_samples, losses = upd.num_samples.tolist(), torch.as_tensor(upd.loss).tolist()
    for r, (lo, hi) in enumerate(slices):
        out[r] = [
            ClientUpdate(
                unstack(upd.upload, j),
                {**unstack(upd.state, j), **unstack(new_kept, j)},
                int(num_samples[j]),
                losses[j],
            )
            for j in range(lo, hi)
        ]
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
