"""FederatedDataModule: builds client partitions once, as tensors, and serves one item per round."""

from __future__ import annotations

import hashlib
import os

import lightning as L
import numpy as np
import torch

from fl_lightning.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from fl_lightning.rounds import ClientSampler, RoundLoader


class FederatedDataModule(L.LightningDataModule):
    """Base class. Subclasses implement ``build() -> FederatedData``.

    Args:
        num_clients: number of clients n.
        clients_per_round: cohort size per round; or give ``participation`` (fraction r of n).
        participation: fraction of clients sampled per round (used when ``clients_per_round`` is unset).
        seed: partition, sampling and local-shuffling seed; defaults to ``seed_everything``'s seed.
    """

    def __init__(
        self,
        num_clients: int = 20,
        clients_per_round: int | None = None,
        participation: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if num_clients < 1:
            raise ConfigError(f"data.num_clients must be ≥ 1, got {num_clients}")
        if participation is not None and not 0 < participation <= 1:
            raise ConfigError(f"data.participation must be in (0, 1], got {participation}")
        if clients_per_round is not None and clients_per_round < 1:
            raise ConfigError(f"data.clients_per_round must be ≥ 1, got {clients_per_round}")
        if clients_per_round is not None and clients_per_round > num_clients:
            raise ConfigError(f"data.clients_per_round={clients_per_round} is more than data.num_clients={num_clients}")
        self.num_clients, self.seed = num_clients, seed
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
        for split in (fed.train, fed.test):
            h.update(split.ptr.cpu().numpy().tobytes())
            h.update(split.y.cpu().numpy().tobytes())
            h.update(split.x.cpu().float().sum(dim=tuple(range(1, split.x.dim()))).numpy().round(4).tobytes())
        return h.hexdigest()[:16]

    # ---- Lightning hooks ----------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self.federated is None:
            self.federated = self.build()
            if self.federated.num_clients != self.num_clients:
                raise ConfigError(
                    f"{type(self).__name__} built {self.federated.num_clients} clients, config says {self.num_clients}"
                )

    def train_dataloader(self) -> RoundLoader:
        rounds = self.trainer.max_steps if self.trainer is not None else -1
        if rounds is None or rounds < 1:
            raise ConfigError("set trainer.max_steps to the number of communication rounds")
        return RoundLoader(ClientSampler(self.num_clients, self.clients_per_round, self.resolved_seed), rounds)
