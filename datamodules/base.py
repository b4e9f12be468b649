"""FederatedDataModule: builds client partitions once, as tensors, and serves one item per round."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import lightning as L
import numpy as np
import torch
from torch import Tensor

from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.rounds import ClientChunks, ClientSampler, RoundLoader, client_chunks
from fl_lightning.errors import ConfigError

VAL_SALT = 90_001  # the validation split's random stream: independent of the partition's


def split_validation(
    train: ClientSplit, fraction: float, num_classes: int | None, rng: np.random.Generator
) -> tuple[ClientSplit, ClientSplit]:
    """Carve a validation split out of every client's training rows: ``(train without val, val)``.

    Client ``c`` with ``n_c`` training rows gives ``round(fraction · n_c)`` of them, at least 1 and at most
    ``n_c − 1``. For classification the count is shared over the client's classes in proportion to their
    training counts (largest remainders, ties broken at random), so val follows the client's own training
    distribution; the rows of each class are drawn uniformly. Row order inside each client is kept.
    """
    sizes = train.sizes.tolist()
    small = [c for c, n in enumerate(sizes) if n < 2]
    if small:
        raise ConfigError(
            f"data.val_fraction={fraction}: clients {small[:10]} have fewer than 2 training samples, "
            "too few to carve a validation split"
        )
    labels = train.y.cpu().numpy() if num_classes is not None else None
    in_val = np.zeros(train.y.shape[0], dtype=bool)
    for c, n in enumerate(sizes):
        lo = int(train.ptr[c])
        quota = min(n - 1, max(1, int(round(fraction * n))))
        if labels is None:
            in_val[lo + rng.choice(n, quota, replace=False)] = True
            continue
        classes, counts = np.unique(labels[lo : lo + n], return_counts=True)
        ideal = quota * counts / n
        take = np.floor(ideal).astype(np.int64)
        order = rng.permutation(len(classes))  # random tie-break, then a stable sort by remainder
        order = order[np.argsort(-(ideal - take)[order], kind="stable")]
        take[order[: quota - int(take.sum())]] += 1
        for cls, k in zip(classes, take):
            rows = lo + np.flatnonzero(labels[lo : lo + n] == cls)
            in_val[rng.permutation(rows)[:k]] = True
    owner = train.client_ids().cpu().numpy()
    keep = torch.from_numpy(~in_val).to(train.y.device)

    def subset(mask: Tensor, rows: np.ndarray) -> ClientSplit:
        ptr = torch.zeros(train.num_clients + 1, dtype=torch.long)
        ptr[1:] = torch.from_numpy(np.bincount(owner[rows], minlength=train.num_clients)).cumsum(0)
        return ClientSplit(train.x[mask.to(train.x.device)], train.y[mask], ptr.to(train.ptr.device))

    return subset(keep, ~in_val), subset(~keep, in_val)


def _bad_rows(split: ClientSplit, num_classes: int | None, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """Rows of ``split`` with a non-finite feature (or regression target), and rows whose class label is outside
    ``[0, num_classes)``; checked in chunks of rows (no copy of the whole data)."""
    n = split.y.shape[0]
    nonfinite = torch.zeros(n, dtype=torch.bool, device=split.y.device)
    out_of_range = torch.zeros(n, dtype=torch.bool, device=split.y.device)
    for lo in range(0, n, chunk):
        x, y = split.x[lo : lo + chunk], split.y[lo : lo + chunk]
        if x.is_floating_point() or x.is_complex():
            nonfinite[lo : lo + len(x)] |= ~torch.isfinite(x.reshape(len(x), -1)).all(1).to(nonfinite.device)
        flat_y = y.reshape(len(y), -1)
        if y.is_floating_point():
            nonfinite[lo : lo + len(y)] |= ~torch.isfinite(flat_y).all(1)
        elif num_classes is not None:
            out_of_range[lo : lo + len(y)] |= ((flat_y < 0) | (flat_y >= num_classes)).any(1)
    return nonfinite, out_of_range


def check_trainable(fed: FederatedData, name: str) -> None:
    """Data that cannot train is refused at ``setup``, once, naming clients and rows: non-finite features (such a
    client's update is not finite and would be dropped round after round) and labels outside ``[0, num_classes)``."""
    for split_name, split in (("train", fed.train), ("test", fed.test), ("val", fed.val)):
        if split is None or split.y.shape[0] == 0:
            continue
        nonfinite, out_of_range = _bad_rows(split, fed.num_classes)
        for bad, what, fix in (
            (nonfinite, "non-finite values (NaN or inf) in their features", "drop or impute those rows"),
            (out_of_range, f"labels outside [0, {fed.num_classes})", "relabel them to 0 … num_classes − 1"),
        ):
            rows = torch.nonzero(bad).flatten().cpu()
            if len(rows):
                owner = split.client_ids().cpu()[rows]
                local = rows - split.ptr.cpu()[owner]
                clients = sorted(set(owner.tolist()))
                examples = ", ".join(f"client {c} row {r}" for c, r in zip(owner[:3].tolist(), local[:3].tolist()))
                raise ConfigError(
                    f"data ({name}): {len(rows)} {split_name} rows of {len(clients)} clients {clients[:10]} have "
                    f"{what} (e.g. {examples}); fix: {fix} before training"
                )


class FederatedDataModule(L.LightningDataModule):
    """Base class. Subclasses implement ``build() -> FederatedData``.

    Args:
        num_clients: number of clients n.
        clients_per_round: cohort size per round; or give ``participation`` (fraction r of n).
        participation: fraction of clients sampled per round (used when ``clients_per_round`` is unset).
        seed: partition, sampling and local-shuffling seed; defaults to ``seed_everything``'s seed.
        val_fraction: carve this fraction of every client's training rows into ``federated.val`` (stratified
            by class, drawn from the seed; see :func:`split_validation`). 0 (the default) carves nothing and
            leaves the data exactly as without it.
    """

    def __init__(
        self,
        num_clients: int = 20,
        clients_per_round: int | None = None,
        participation: float | None = None,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        if num_clients < 1:
            raise ConfigError(f"data.num_clients must be ≥ 1, got {num_clients}")
        if participation is not None and not 0 < participation <= 1:
            raise ConfigError(f"data.participation must be in (0, 1], got {participation}")
        if clients_per_round is not None and clients_per_round < 1:
            raise ConfigError(f"data.clients_per_round must be ≥ 1, got {clients_per_round}")
        if clients_per_round is not None and clients_per_round > num_clients:
            raise ConfigError(f"data.clients_per_round={clients_per_round} is more than data.num_clients={num_clients}")
        self.num_clients, self.seed, self.val_fraction = num_clients, seed, val_fraction
        if clients_per_round is None:
            clients_per_round = max(1, round((participation if participation is not None else 0.1) * num_clients))
        self.clients_per_round = clients_per_round
        self.federated: FederatedData | None = None

    # ---- to implement -------------------------------------------------------------------------------------
    def build(self) -> FederatedData:
        raise NotImplementedError

    # ---- helpers ------------------------------------------------------------------------------------------
    @property
    def resolved_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def rng(self, *salt: int) -> np.random.Generator:
        return np.random.default_rng([self.resolved_seed, *salt])

    def make_federated(
        self, x_train, y_train, train_sets, x_test, y_test, test_sets, num_classes, **kw
    ) -> FederatedData:
        train = ClientSplit.from_indices(x_train, y_train, train_sets)
        test = ClientSplit.from_indices(x_test, y_test, test_sets)
        empty = torch.nonzero(train.sizes == 0).flatten().tolist()
        if empty:
            raise ConfigError(f"{type(self).__name__}: clients {empty[:10]} have no training samples")
        return FederatedData(train, test, num_classes, seed=self.resolved_seed, **kw)

    def partition_hash(self) -> str:
        """A short hash of who owns which samples (identical for the same seed on every machine)."""
        fed = self.federated
        h = hashlib.sha256()
        for split in (fed.train, fed.test) if fed.val is None else (fed.train, fed.test, fed.val):
            h.update(split.ptr.cpu().numpy().tobytes())
            h.update(split.y.cpu().numpy().tobytes())
            h.update(split.x.cpu().float().sum(dim=tuple(range(1, split.x.dim()))).numpy().round(4).tobytes())
        return h.hexdigest()[:16]

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.federated is None:
            fed = self.build()
            if fed.num_clients != self.num_clients:
                raise ConfigError(
                    f"{type(self).__name__} built {fed.num_clients} clients, config says {self.num_clients}"
                )
            check_trainable(fed, type(self).__name__)
            if self.val_fraction > 0:
                train, val = split_validation(fed.train, self.val_fraction, fed.num_classes, self.rng(VAL_SALT))
                fed = replace(fed, train=train, val=val)
            self.federated = fed
        self._check_evaluation(stage)

    def _check_evaluation(self, stage: str | None) -> None:
        """An empty evaluation split makes every accuracy NaN: refused, unless the run turns evaluation off
        (``trainer.limit_val_batches: 0``, for fit and validate)."""
        fed = self.federated
        split = fed.test if stage == "test" or fed.val is None else fed.val
        if split.y.shape[0] > 0 or stage not in ("fit", "validate", "test", None):
            return
        limit = getattr(self.trainer, "limit_val_batches", None) if self.trainer is not None else None
        if stage != "test" and limit is not None and limit == 0:
            return
        fraction = getattr(self, "test_fraction", None)
        fraction = getattr(getattr(self, "partition", None), "test_fraction", None) if fraction is None else fraction
        given = f" (test_fraction={fraction})" if fraction is not None else ""
        raise ConfigError(
            f"data ({type(self).__name__}): the test split is empty{given}: 0 rows for all {fed.num_clients} clients, "
            "so every accuracy would be NaN; fix: set data.init_args.test_fraction > 0 (e.g. 0.2), or turn "
            "evaluation off with --trainer.limit_val_batches 0"
        )

    def train_dataloader(self) -> RoundLoader:
        rounds = self.trainer.max_steps if self.trainer is not None else -1
        if rounds is None or rounds < 1:
            raise ConfigError("set trainer.max_steps to the number of communication rounds")
        return RoundLoader(ClientSampler(self.num_clients, self.clients_per_round, self.resolved_seed), rounds)

    def val_dataloader(self) -> ClientChunks:
        """Validation: every client evaluates on its own test split; a "batch" is a chunk of client ids."""
        return client_chunks(self.num_clients, self.trainer)

    def test_dataloader(self) -> ClientChunks:
        return client_chunks(self.num_clients, self.trainer)
