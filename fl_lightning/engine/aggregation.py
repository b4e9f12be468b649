"""Aggregation: the server's side of a round.

The clients of a round are split over the ranks, balanced by training samples (``assign_clients``: a pure function
of the cohort and the client sizes, so every rank computes the same split). Each rank adds up what its own clients
report (``collect``): the weighted sum of the upload deltas Σ_k w_k (θ_k − θ) in float64, its clients' new
client-state rows, and the round's statistics, all on the device (no host reads per client). Then
``CohortSums.all_reduce``: one sum-all-reduce of the sums and statistics, and one all-gather per dtype of the
state rows, in which each rank sends only the rows of its own clients (the identity on one process). The weighted
mean Δ = Σ w_k (θ_k − θ) / Σ w_k is applied by ``server_step``: model parameters through the server optimiser with
the pseudo-gradient −Δ (``SGD(lr=1)`` gives FedAvg, McMahan et al. 2017, eq. in §2), buffers directly, and any
other upload (e.g. a control-variate delta) by the algorithm's ``server_update``.

**The communication ledger** (``CommunicationLedger``) is the one place every client upload passes through, a stage
of ``Aggregation.collect``; it also counts what the server sends (``download``). It enforces the privacy boundary
from the algorithm's *declarations*, not from its code: an upload name under one of the algorithm's ``personal`` or
``state_prefixes`` prefixes, or named like an entry of the client-state bank, is refused (the declared upload
template may not contain one either), and so is any name outside the declared template. It also records, per round,
how many upload bytes the algorithm declares to depend on the clients' personal state or side information
(``Algorithm.reveals``), and counts the bytes of the communication metrics. What crosses the boundary is not
"nothing personal": the README's table lists, per algorithm, what an upload may reveal;
``tests/properties/test_privacy.py`` checks each declaration by perturbing the personal state and the side
information and comparing the uploads bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import astuple, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import Params, name_matches, per_client
from fl_lightning.engine.sequential import to_device

log = logging.getLogger("fl_lightning")


# ---- the communication ledger: what crosses between the clients and the server ---------------------------------
class PrivacyViolation(RuntimeError):
    pass


@dataclass
class RoundDisclosure:
    """One round's uploads and how many of their bytes may depend on personal state or side information."""

    round: int
    uploads: int = 0
    bytes: int = 0
    state_dependent_bytes: int = 0
    side_dependent_bytes: int = 0


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name_matches(name, p) for p in prefixes)


class CommunicationLedger:
    """Checks and counts every upload of one run.

    Args:
        personal: the algorithm's declared personal prefixes (model parameters that stay on the client).
        state_prefixes: its declared prefixes of other per-client state (Ditto ``v.``, SCAFFOLD ``c_i.``…).
        state_names: the names the client-state bank actually holds.
        template: the declared upload (name → tensor template); checked against the three above.
        reveals: the algorithm's one-line description of what its uploads may reveal.
        state_dependent: upload-name prefixes the algorithm declares may depend on personal state ("" = all).
        side_dependent: upload-name prefixes that may depend on side information (empty when the run has none).
        side_reveals: what the side-information branch lets the server read off an upload (None: no side info).
    """

    #: called as ``observer(ledger, round, client, upload)`` for every upload of every ledger (tests, audits)
    global_observers: list[Callable[[CommunicationLedger, int, int, dict[str, Tensor]], None]] = []

    def __init__(
        self,
        personal: Collection[str],
        state_prefixes: Collection[str],
        state_names: Collection[str],
        template: Collection[str],
        reveals: str = "",
        state_dependent: Collection[str] = (),
        side_dependent: Collection[str] = (),
        side_reveals: str | None = None,
    ) -> None:
        self.personal, self.state_prefixes = tuple(personal), tuple(state_prefixes)
        self.state_names = frozenset(state_names)
        self.reveals, self.side_reveals = reveals, side_reveals
        self.state_dependent, self.side_dependent = tuple(state_dependent), tuple(side_dependent)
        for name in template:
            if self.is_private(name):
                raise PrivacyViolation(
                    f"the upload template declares '{name}', which is personal client state "
                    "(a personal or state prefix of the algorithm, or a client-bank entry)"
                )
        self.allowed = frozenset(template)
        self.upload_bytes = 0
        self.download_bytes = 0
        self.history: list[RoundDisclosure] = []
        self.observers: list[Callable[[int, int, dict[str, Tensor]], None]] = []
        self._kinds: dict[str, tuple[bool, bool, bool]] = {}  #: ``_kind`` per upload name, matched once
        self._upload_kinds: dict[tuple[str, ...], list[tuple[bool, bool, bool]]] = {}  #: per upload's names

    def _kind(self, name: str) -> tuple[bool, bool, bool]:
        """(refused, state-dependent, side-dependent) of an upload name: its prefixes are matched once per run."""
        kind = self._kinds.get(name)
        if kind is None:
            refused = name not in self.allowed or self.is_private(name)
            kind = (refused, _under(name, self.state_dependent), _under(name, self.side_dependent))
            self._kinds[name] = kind
        return kind

    @classmethod
    def for_algorithm(
        cls, algorithm: Any, state_names: Collection[str], template: Collection[str], side_reveals: str | None
    ) -> CommunicationLedger:
        """The ledger of a run, from the algorithm's declared attributes (never from its methods).
        ``side_reveals`` is None when the run has no side information."""
        return cls(
            algorithm.personal,
            algorithm.state_prefixes,
            state_names,
            template,
            algorithm.reveals,
            algorithm.state_dependent_uploads,
            algorithm.side_dependent_uploads if side_reveals is not None else (),
            side_reveals,
        )

    def is_private(self, name: str) -> bool:
        """Whether ``name`` is declared client-private: never uploaded, whatever the algorithm's code does."""
        return _under(name, self.personal) or _under(name, self.state_prefixes) or name in self.state_names

    def new_round(self, round_idx: int = -1) -> None:
        self.upload_bytes = 0
        self.download_bytes = 0
        self.history.append(RoundDisclosure(round_idx))

    def upload(self, round_idx: int, client: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        names = tuple(tensors)
        kinds = self._upload_kinds.get(names)
        if kinds is None:  # an upload's names are the same every round: matched once
            kinds = self._upload_kinds[names] = [self._kind(name) for name in names]
        for name, (refused, _, _) in zip(names, kinds):
            if refused:
                raise PrivacyViolation(
                    f"client {client} tried to upload '{name}' in round {round_idx}: "
                    "it is personal client state or not in the algorithm's declared upload"
                )
        sizes = [t.numel() * t.element_size() for t in tensors.values()]  # tensor_bytes, per tensor
        size = sum(sizes)
        self.upload_bytes += size
        if not self.history or self.history[-1].round != round_idx:
            self.history.append(RoundDisclosure(round_idx))
        record = self.history[-1]
        record.uploads += 1
        record.bytes += size
        record.state_dependent_bytes += sum(b for b, k in zip(sizes, kinds) if k[1])
        record.side_dependent_bytes += sum(b for b, k in zip(sizes, kinds) if k[2])
        for observer in self.observers:
            observer(round_idx, client, tensors)
        for observer in CommunicationLedger.global_observers:
            observer(self, round_idx, client, tensors)
        return tensors

    def download(self, tensors: dict[str, Tensor], num_clients: int) -> None:
        self.download_bytes += tensor_bytes(tensors) * num_clients

    def describe(self) -> str:
        """What this run's uploads may reveal, in words (the algorithm's declaration plus the side branch's)."""
        parts = [self.reveals or "nothing beyond the declared upload"]
        if self.side_reveals:
            parts.append(self.side_reveals)
        return "; ".join(parts)


def tensor_bytes(tensors: dict[str, Tensor]) -> int:
    """The bytes of ``tensors`` on the wire: Σ numel × element size."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---- the round's clients over the ranks, their sums, the server step ---------------------------------------------

def assign_clients(sizes: Sequence[int], world: int) -> list[list[int]]:
    """The cohort positions each rank trains, balanced by sample count: largest client first, each to the rank
    with the fewest samples so far (then the fewest clients, then the lowest rank); positions in cohort order.
    With equal sizes this is ``cohort[rank::world]``'s round robin."""
    loads, out = [0] * world, [[] for _ in range(world)]
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(world), key=lambda r: (loads[r], len(out[r]), r))
        out[r].append(j)
        loads[r] += sizes[j]
    return [sorted(positions) for positions in out]


@dataclass
class RoundStats:
    """Counts of one round (summed over ranks)."""

    weight: float = 0.0  #: Σ of the survivors' aggregation weights
    weighted_loss: float = 0.0  #: Σ weight · local training loss
    samples: float = 0.0  #: training samples of the survivors
    survivors: float = 0.0  #: clients whose update was aggregated
    dropped: float = 0.0  #: clients that failed before reporting (``client_dropout``)
    non_finite: float = 0.0  #: clients whose update was not finite (dropped)
    stragglers: float = 0.0  #: clients that stopped early and reported what they had
    upload_bytes: float = 0.0  #: bytes uploaded by the cohort

    @property
    def mean_loss(self) -> float:
        return self.weighted_loss / max(self.weight, 1e-12)

    def to_tensor(self, device: torch.device | str) -> Tensor:
        return to_device(torch.tensor(astuple(self), dtype=torch.float64), torch.device(device))

    @classmethod
    def from_tensor(cls, values: Tensor) -> RoundStats:
        return cls(*(float(v) for v in values.tolist()))

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))


@dataclass
class CohortSums:
    """What the clients of a round report, added up: this rank's clients, then (after ``all_reduce``) all.

    Before ``all_reduce`` the statistics that depend on the clients' values (weights, losses, survivors) are the
    device tensor ``counts`` (added to ``stats`` by the reduction, which reads them back once)."""

    delta_sums: Params  #: Σ_k w_k (upload_k − global) for model tensors, Σ_k w_k upload_k for other uploads (float64)
    state_rows: Params  #: new client-state rows ``[R, ...]`` of the clients ``positions`` (cohort positions)
    positions: list[int]
    stats: RoundStats
    counts: Tensor | None = None  #: [weight, weighted_loss, samples, survivors, non_finite] before the reduction
    finite: Tensor | None = None  #: which of ``positions`` sent finite values (this rank)
    notes: dict[str, Any] = field(default_factory=dict)
    #: after ``all_reduce``: ``delta_sums`` laid end to end in float64 (they are views of it), and their names
    flat_sums: Tensor | None = None
    flat_names: tuple[str, ...] = ()

    def all_reduce(
        self, strategy: Any, device: torch.device, layout: Sequence[Sequence[int]] | None = None
    ) -> CohortSums:
        """Sum the deltas and statistics over ranks with one all-reduce, and gather the state rows: ``layout[r]``
        are the cohort positions whose rows rank ``r`` sends (each rank its own clients only). On one process
        the reduction is the identity."""
        stats = self.stats.to_tensor(device)
        if self.counts is not None:
            stats = stats + torch.cat([self.counts[:4], stats.new_zeros(1), self.counts[4:], stats.new_zeros(2)])
        flat = torch.cat([t.reshape(-1).double() for t in self.delta_sums.values()] + [stats])
        flat = strategy.reduce(flat, reduce_op="sum")
        sums, i = {}, 0
        for n, t in self.delta_sums.items():
            sums[n] = flat[i : i + t.numel()].view(t.shape).to(t.dtype)
            i += t.numel()
        total = RoundStats.from_tensor(flat[i:])  # the round's one read of the device
        if total.non_finite and self.finite is not None:
            self._log_non_finite()
        float64 = all(t.dtype == torch.float64 for t in self.delta_sums.values())
        laid = {"flat_sums": flat[:i], "flat_names": tuple(sums)} if float64 else {}
        world = getattr(strategy, "world_size", 1)
        if world == 1 or layout is None:
            return CohortSums(sums, self.state_rows, self.positions, total, **laid)
        rows, positions = gather_rows(strategy, self.state_rows, layout)
        return CohortSums(sums, rows, positions, total, **laid)

    def _log_non_finite(self) -> None:
        bad = (~self.finite).nonzero().flatten().tolist()  # only when some client sent non-finite values
        for k in bad:
            client = self.notes["clients"][k]
            log.warning("round %d: client %d sent a non-finite update; it is dropped", self.notes["round"], client)

    def mean_update(self, template: Params) -> Params:
        """The weighted mean Δ, in each tensor's dtype (integer buffers stay float64 and are rounded on apply);
        empty if no client survived."""
        if self.stats.weight <= 0:
            return {}
        weight = torch.tensor(self.stats.weight, dtype=torch.float64)
        dtypes = {template[n].dtype for n in self.delta_sums}
        if self.flat_sums is not None and tuple(self.delta_sums) == self.flat_names and len(dtypes) == 1:
            (dtype,) = dtypes  # one dtype: the same two operations on the sums laid end to end
            flat = self.flat_sums.to(dtype) if dtype.is_floating_point else self.flat_sums
            means = flat / weight.to(flat.device)
            out, i = {}, 0
            for n, v in self.delta_sums.items():
                # a 0-d sum divided alone promotes to float64 (two 0-d tensors): it is divided alone, as before
                out[n] = means[i : i + v.numel()].view(v.shape) if v.dim() else v.to(dtype) / weight.to(v.device)
                i += v.numel()
            return out
        sums = {n: v.to(t.dtype) if (t := template[n]).is_floating_point() else v for n, v in self.delta_sums.items()}
        return {n: s / weight.to(s.device) for n, s in sums.items()}


def gather_rows(strategy: Any, rows: Params, layout: Sequence[Sequence[int]]) -> tuple[Params, list[int]]:
    """Every rank's state rows, each rank sending only its own (``layout[r]`` positions, padded to the longest
    rank's count): one all-gather per dtype. Returns the rows of all ranks and their cohort positions."""
    width = max((len(p) for p in layout), default=0)
    positions = [j for p in layout for j in p]
    if width == 0 or not rows:
        return {n: v[:0] for n, v in rows.items()}, positions
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n, v in rows.items():
        by_dtype.setdefault(v.dtype, []).append(n)
    out: Params = {}
    keep = [r * width + i for r, p in enumerate(layout) for i in range(len(p))]
    some = next(iter(rows.values()))
    keep_t = to_device(torch.tensor(keep, dtype=torch.long), some.device)
    for names in by_dtype.values():
        # explicit widths: a rank that holds no client of this round has 0 rows (reshape(0, -1) is ambiguous)
        mine = torch.cat([rows[n].reshape(rows[n].shape[0], _row_size(rows[n])) for n in names], dim=1)
        padded = mine.new_zeros(width, mine.shape[1])
        padded[: mine.shape[0]] = mine
        gathered = strategy.all_gather(padded).reshape(-1, mine.shape[1]).index_select(0, keep_t)
        i = 0
        for n in names:
            size = _row_size(rows[n])
            out[n] = gathered[:, i : i + size].reshape(len(keep), *rows[n].shape[1:])
            i += size
    return out, positions


def _row_size(t: Tensor) -> int:
    """Elements per row of ``t`` ``[K, ...]``, also when ``K`` is 0."""
    return int(torch.Size(t.shape[1:]).numel())


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    """A ``[K]`` mask shaped to select rows of ``like`` ``[K, ...]``."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


Weighting = Literal["uniform", "num_samples"]


@dataclass
class Ranks:
    """Where a round's sums meet: Lightning's ``strategy`` (``reduce``, ``all_gather``, ``world_size``), this
    process's ``rank``, the ``device`` of the sums, and ``layout[r]``, the cohort positions rank ``r`` reports."""

    strategy: Any
    rank: int
    device: torch.device
    layout: Sequence[Sequence[int]]


@dataclass
class RoundReports:
    """One rank's share of a round, what ``Aggregation.collect`` adds up: ``cohort`` are the round's client ids
    (host), ``active`` this rank's positions in it that did not fail, ``updates[k]`` is ``active[k]``'s report;
    ``cohort_states`` the cohort's client-state rows before the round (a dropped client keeps its row)."""

    round_idx: int
    cohort: Sequence[int]
    active: list[int]
    updates: list[ClientUpdate]
    global_params: Params
    template: Params
    cohort_states: Params


class Aggregation:
    """The server side of a round as one pipeline: clip each upload → the ledger → sum (weighted, float64) → noise →
    sum over ranks → mean → server step. Without privacy the clip and the noise are the identity and the mean
    divides by the sum of the weights; ``fl_lightning.engine.privacy.PrivateAggregation`` wraps it with DP's
    stages (as Flower's differential-privacy strategies wrap a strategy)."""

    def __init__(self, ledger: CommunicationLedger, weighting: Weighting, algorithm_name: str) -> None:
        self.ledger, self.weighting, self.algorithm_name = ledger, weighting, algorithm_name

    def clip(self, upload: Params, glob: Params, round_idx: int, client: int) -> Params:
        """One client's upload as it crosses the boundary (unchanged here)."""
        return upload

    def noise(self, delta_sums: Params, round_idx: int, rank: int) -> Params:
        """This rank's sums before the sum over ranks (unchanged here)."""
        return delta_sums

    def mean(self, sums: CohortSums, template: Params) -> Params:
        """The mean update Δ from the all-reduced sums: divided by the sum of the survivors' weights."""
        return sums.mean_update(template)

    def aggregate(self, reports: RoundReports, stats: RoundStats, ranks: Ranks) -> CohortSums:
        """collect → noise → one sum over the ranks (``Ranks``: Lightning's strategy, this rank, the device, and which
        cohort positions' state rows each rank sends)."""
        sums = self.collect(reports, stats)
        sums.delta_sums = self.noise(sums.delta_sums, reports.round_idx, ranks.rank)
        return sums.all_reduce(ranks.strategy, ranks.device, ranks.layout)

    def collect(self, reports: RoundReports, stats: RoundStats) -> CohortSums:
        """Add up this rank's reports: every upload is clipped (``clip``) and passes the ``ledger``; a report that is
        not finite is dropped (and counted, on the device); the state rows returned are those of ``active``."""
        round_idx, cohort, active, updates = reports.round_idx, reports.cohort, reports.active, reports.updates
        global_params, template, cohort_states = reports.global_params, reports.template, reports.cohort_states
        for j, upd in zip(active, updates):
            upd.upload = self.clip(upd.upload, global_params, round_idx, cohort[j])
            self.ledger.upload(round_idx, cohort[j], upd.upload)
            if set(upd.upload) != set(template):
                raise RuntimeError(f"{self.algorithm_name} uploaded {sorted(upd.upload)}, not its template")
        stats.upload_bytes += self.ledger.upload_bytes
        device = next(iter(global_params.values())).device if global_params else torch.device("cpu")
        if not updates:
            sums = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in template.items()}
            return CohortSums(sums, {n: v[:0] for n, v in cohort_states.items()}, [], stats)
        ups, news = [u.upload for u in updates], [u.state for u in updates]
        blocks = ClientColumns.of(ups, news, list(template), list(cohort_states), global_params)
        loose = {n: torch.stack([p[n] for p in ups]) for n in blocks.loose_uploads}  # integer uploads and the like
        loose_rows = {n: torch.stack([p[n] for p in news]) for n in blocks.loose_states}
        finite = blocks.finite(len(updates), device)
        for t in (*loose.values(), *loose_rows.values()):
            if t.is_floating_point():
                finite = finite & torch.isfinite(t).reshape(len(updates), -1).all(1)
        host = [float(u.num_samples) if self.weighting == "num_samples" else 1.0 for u in updates]
        sizes = [float(u.num_samples) for u in updates]
        host_t = to_device(torch.tensor([host, sizes], dtype=torch.float64), device)
        weight = torch.where(finite, host_t[0], 0.0)
        losses = client_losses([u.loss for u in updates], device)
        sums = blocks.weighted_delta_sums(finite, weight, global_params)
        for n, v in loose.items():
            delta = v - global_params[n] if n in global_params else v
            if not delta.is_floating_point():
                delta = delta.double()
            delta = torch.where(_rows(finite, delta), delta, 0.0)
            sums[n] = (per_client(weight, delta) * delta).double().sum(0)
        sums = {n: sums[n] for n in template}  # in the template's order
        every = list(active) == list(range(len(cohort)))  # then the old rows are the cohort's rows as they are
        index = None if every else to_device(torch.tensor(active, dtype=torch.long), device)
        rows = {}
        for n in cohort_states:
            v = loose_rows[n] if n in loose_rows else blocks.state(n)
            old = cohort_states[n] if index is None else cohort_states[n].index_select(0, index)
            rows[n] = torch.where(_rows(finite, v), v.to(old.dtype), old)
        counts = torch.stack(
            [weight.sum(), torch.where(finite, weight * losses, 0.0).sum(), torch.where(finite, host_t[1], 0.0).sum(),
             finite.double().sum(), (~finite).double().sum()]
        )  # fmt: skip
        notes = {"round": round_idx, "clients": [cohort[j] for j in active]}
        return CohortSums(sums, rows, list(active), stats, counts, finite, notes)


def rows_finite(flat: Tensor) -> Tensor:
    """``[K]``: whether every value of row k of ``flat`` ``[K, P]`` is finite, as ``isfinite(flat).all(1)``: the
    largest magnitude of a row is finite exactly when all are (a NaN propagates through ``amax``); a float pass and a
    reduction, without ``isfinite``'s boolean pass (slow on the CPU)."""
    if flat.shape[1] == 0:
        return torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
    return torch.isfinite(flat.abs().amax(1))


def client_losses(losses: list[Any], device: torch.device) -> Tensor:
    """The clients' training losses as one float64 ``[K]`` tensor on ``device``: each as ``torch.as_tensor`` makes
    it (a Python float in the default dtype), then float64; one call when they are all floats or all 0-d tensors
    of one dtype and device."""
    if all(type(v) is float for v in losses):
        return to_device(torch.tensor(losses), device).double()
    if all(isinstance(v, Tensor) and v.numel() == 1 and v.device == device for v in losses) and len(
        {v.dtype for v in losses}
    ) == 1:
        return torch.stack([v.reshape(()) for v in losses]).double()
    return torch.stack([torch.as_tensor(v, device=device).reshape(()).double() for v in losses])


@dataclass
class ClientColumns:
    """The clients' floating uploads and new state rows, per dtype, side by side in one client-major ``[K, P]``
    buffer (``flat[k]`` is client k's tensors flattened in ``names`` order): the finite check and the weighted
    delta are one operation per dtype instead of one per tensor. Each upload's weighted sum is still taken over its
    own contiguous ``[K, ...]`` block, as the per-tensor sum takes it (a sum over a wider buffer may add in
    another order). Tensors that do not fit (integer ones, an upload whose global tensor has another dtype) are
    ``loose_*`` and take the per-tensor path."""

    flats: dict[torch.dtype, Tensor]  #: per dtype, ``[K, P]``
    spans: dict[tuple[str, str], tuple[torch.dtype, int, int, torch.Size]]  #: (kind, name) -> dtype, columns, shape
    uploads: dict[torch.dtype, list[str]]  #: per dtype, the uploads at its first columns, in order
    loose_uploads: list[str]
    loose_states: list[str]

    @classmethod
    def of(
        cls, ups: list[Params], news: list[Params], upload_names: list[str], state_names: list[str], glob: Params
    ) -> ClientColumns:
        names: dict[torch.dtype, list[tuple[str, str]]] = {}
        loose_uploads, loose_states = [], []
        for n in upload_names:
            t = ups[0][n]
            if t.is_floating_point() and (n not in glob or glob[n].dtype == t.dtype):
                names.setdefault(t.dtype, []).append(("upload", n))
            else:
                loose_uploads.append(n)
        for n in state_names:
            t = news[0][n]
            if t.is_floating_point():
                names.setdefault(t.dtype, []).append(("state", n))
            else:
                loose_states.append(n)
        flats, spans, uploads = {}, {}, {}
        source = {"upload": ups, "state": news}
        for dtype, keys in names.items():
            i = 0
            for kind, n in keys:
                shape = source[kind][0][n].shape
                spans[kind, n] = (dtype, i, i + shape.numel(), shape)
                i += shape.numel()
            pieces = [source[kind][k][n].reshape(-1) for k in range(len(ups)) for kind, n in keys]
            flats[dtype] = torch.cat(pieces).view(len(ups), i)
            uploads[dtype] = [n for kind, n in keys if kind == "upload"]
        return cls(flats, spans, uploads, loose_uploads, loose_states)

    def finite(self, k: int, device: torch.device) -> Tensor:
        """``[K]``: whether every floating value of client k is finite (over the buffers; loose tensors apart)."""
        finite = None
        for flat in self.flats.values():
            finite = rows_finite(flat) if finite is None else finite & rows_finite(flat)
        return torch.ones(k, dtype=torch.bool, device=device) if finite is None else finite

    def state(self, name: str) -> Tensor:
        """The new rows ``[K, ...]`` of the buffered state ``name`` (a view of its buffer's columns)."""
        dtype, a, b, shape = self.spans["state", name]
        return self.flats[dtype][:, a:b].view(-1, *shape)

    def weighted_delta_sums(self, finite: Tensor, weight: Tensor, glob: Params) -> Params:
        """Σ_k w_k (upload_k − global) per buffered upload (Σ_k w_k upload_k outside the model), float64; a client
        that is not finite adds nothing. Elementwise as ``collect``'s per-tensor path, then each upload's own sum."""
        sums: Params = {}
        for dtype, names in self.uploads.items():
            if not names:
                continue
            flat = self.flats[dtype]
            end = self.spans["upload", names[-1]][2]
            cols = flat[:, :end]
            base = torch.cat([glob[n].reshape(-1) if n in glob else cols.new_zeros(self.spans["upload", n][3].numel())
                              for n in names])  # fmt: skip
            delta = torch.where(finite.view(-1, 1), cols - base, 0.0)
            weighted = weight.to(dtype).view(-1, 1) * delta
            for n in names:
                _, a, b, shape = self.spans["upload", n]
                block = weighted[:, a:b].to(torch.float64, memory_format=torch.contiguous_format)
                sums[n] = block.view(-1, *shape).sum(0)
        return sums


def scatter_state(bank: Any, cohort: Sequence[int], sums: CohortSums) -> None:
    """Write the cohort's new client-state rows into the bank (rows of ``sums.positions``)."""
    if not sums.positions or not sums.state_rows:
        return
    device = next(iter(sums.state_rows.values())).device
    bank.scatter(to_device(torch.tensor([cohort[j] for j in sums.positions]), device), sums.state_rows)


def add_delta(value: Tensor, delta: Tensor) -> Tensor:
    """``value + delta`` in ``value``'s dtype; integer buffers (BatchNorm's batch counter) are rounded."""
    if value.dtype.is_floating_point:
        return value + delta.to(value.dtype)
    return (value.double() + delta).round().to(value.dtype)


def server_step(net: nn.Module, optimizer: Any, algorithm: Algorithm, mean_update: Params, facts: RoundFacts) -> None:
    """Apply the mean update Δ: parameters by one server-optimiser step on the pseudo-gradient −Δ, buffers
    by adding Δ, and the remaining uploads through ``algorithm.server_update`` with the round's ``facts``."""
    optimizer.zero_grad()
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    for n, delta in mean_update.items():
        if n in params:
            params[n].grad = -delta
    optimizer.step()
    with torch.no_grad():
        for n, delta in mean_update.items():
            if n in buffers:
                buffers[n].copy_(add_delta(buffers[n], delta))
        extra = {n: v for n, v in mean_update.items() if n not in params and n not in buffers}
        algorithm.server_update({**params, **buffers}, extra, facts)


class TrainingDiverged(RuntimeError):
    """The global model became NaN/Inf (the last good state is checkpointed)."""


def all_finite(tensors: Iterable[Tensor]) -> Tensor:
    """A 0-d bool tensor: whether every value of every tensor is finite (``isfinite(t).all()`` for all of them),
    one reduction per dtype over the tensors laid end to end; real floating tensors by their largest magnitude
    (``rows_finite``)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    checks = []
    for dtype, pieces in by_dtype.items():
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if flat.numel() == 0:
            continue
        checks.append(flat.abs().amax().isfinite() if dtype.is_floating_point else torch.isfinite(flat).all())
    if len(checks) == 1:
        return checks[0]
    return torch.stack(checks).all() if checks else torch.tensor(True)


class ParamBackup:
    """A copy of some of a network's parameters, laid end to end per dtype (one copy per dtype instead of one per
    tensor); ``restore`` writes them back."""

    def __init__(self, params: Iterable[tuple[str, Tensor]]) -> None:
        self.names: dict[torch.dtype, list[tuple[str, torch.Size]]] = {}
        pieces: dict[torch.dtype, list[Tensor]] = {}
        for n, p in params:
            self.names.setdefault(p.dtype, []).append((n, p.shape))
            pieces.setdefault(p.dtype, []).append(p.detach().reshape(-1))
        self.flats = {dtype: torch.cat(ts) for dtype, ts in pieces.items()}  # cat copies, also a single tensor

    def tensors(self) -> Params:
        """name -> the saved tensor (views of the copies)."""
        out: Params = {}
        for dtype, names in self.names.items():
            i = 0
            for n, shape in names:
                out[n] = self.flats[dtype][i : i + shape.numel()].view(shape)
                i += shape.numel()
        return out

    def restore(self, net: nn.Module) -> None:
        saved = self.tensors()
        with torch.no_grad():
            for n, p in net.named_parameters():
                if n in saved:  # frozen parameters that never change are not backed up
                    p.copy_(saved[n])


def check_finite(net: nn.Module, backup: ParamBackup, trainer: Any, round_idx: int) -> None:
    """Stop with a one-line error if the global model turned non-finite, after restoring ``backup`` (the model
    before the round) and saving it as ``checkpoints/last_good_roundNNNNN.ckpt``."""
    if bool(all_finite(net.parameters())):  # one read
        return
    backup.restore(net)
    path = Path(trainer.default_root_dir) / "checkpoints" / f"last_good_round{round_idx:05d}.ckpt"
    trainer.save_checkpoint(str(path))
    raise TrainingDiverged(
        f"round {round_idx}: the global model became non-finite; the state before this round is saved at {path}"
    )
