"""Shared machinery of the dataset modules: load pools once, partition, split off new clients, report.

A subclass implements ``load() -> Pools`` (all samples as tensors, the dataset's own train/test split and,
for natural datasets, each sample's owner). :class:`PartitionedDataModule` then

1. optionally keeps only ``classes`` for the federation and moves ``transfer_classes`` to new clients
   (class-disjoint transfer, spec 004 §4.2: CIFAR-100 classes 0–79 train, 80–99 are new clients);
2. partitions the pools over ``num_clients + holdout_clients`` clients with ``partition``;
3. moves the ``holdout_clients`` (chosen at random) out of the federation: held-out clients that never
   train (FedRep Fig. 6);
4. exposes the training federation as ``self.federated`` and the new clients (held-out or transfer) as
   ``self.new_clients`` — a second :class:`FederatedData` with the same ``augment``, or ``None``.

For natural datasets ``self.group_names`` lists the owners (LEAF users, alphabets),
``self.client_groups`` the owner of every client, and ``federated.extras["group"]`` its owner id.

When a trainer with loggers runs ``setup``, the partition report (hash, per-client counts, class
histograms, a clients × classes PNG) is written to ``<run dir>/partition/`` and logged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from datamodules.base import FederatedDataModule
from datamodules.partition import Partitioner, Shards, partition_pools
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError


@dataclass
class Pools:
    """All samples of a dataset: its own train/test split, class count, optional owners (groups)."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    g_train: Tensor | None = None
    g_test: Tensor | None = None
    group_names: list[str] | None = None
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None


def _select_classes(pools: Pools, classes: Sequence[int]) -> Pools:
    """Keep samples of ``classes`` and relabel them ``0..len(classes)-1`` in the given order."""
    lut = torch.full((max(pools.num_classes, max(classes) + 1),), -1, dtype=torch.long)
    lut[torch.as_tensor(list(classes))] = torch.arange(len(classes))

    def pick(x, y, g):
        keep = lut[y] >= 0
        return x[keep], lut[y[keep]], None if g is None else g[keep]

    x_tr, y_tr, g_tr = pick(pools.x_train, pools.y_train, pools.g_train)
    x_te, y_te, g_te = pick(pools.x_test, pools.y_test, pools.g_test)
    return Pools(x_tr, y_tr, x_te, y_te, len(classes), g_tr, g_te, pools.group_names, pools.augment)


class PartitionedDataModule(FederatedDataModule):
    """Base of the dataset modules (see the module docstring).

    Args:
        num_clients: clients in the training federation.
        partition: a partitioner from ``datamodules.partition``.
        classes: keep only these classes (relabelled 0..k-1 in this order); ``None`` keeps all but
            ``transfer_classes``.
        holdout_clients: extra clients cut by the same partition that never train (``new_clients``).
        transfer_classes: classes reserved for new clients (relabelled 0..k-1 in this order).
        transfer_clients: number of new clients over ``transfer_classes``.
        transfer_partition: how to split the transfer classes (default: every new client gets an equal
            share of every transfer class, ``Shards(len(transfer_classes))``).
        write_report: write and log the partition report when a trainer with loggers sets the module up.
        val_fraction: fraction of every training client's training rows carved into ``federated.val``
            (see :class:`~datamodules.base.FederatedDataModule`); new clients get none.
    """

    def __init__(
        self,
        num_clients: int = 100,
        partition: Partitioner | None = None,
        classes: list[int] | None = None,
        holdout_clients: int = 0,
        transfer_classes: list[int] | None = None,
        transfer_clients: int = 0,
        transfer_partition: Partitioner | None = None,
        write_report: bool = True,
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed, val_fraction)
        if holdout_clients < 0 or transfer_clients < 0:
            raise ConfigError("holdout_clients and transfer_clients must be ≥ 0")
        if holdout_clients and transfer_classes:
            raise ConfigError("use either holdout_clients or transfer_classes for new clients, not both")
        if bool(transfer_classes) != bool(transfer_clients):
            raise ConfigError("transfer_classes and transfer_clients must be given together")
        if classes and transfer_classes and set(classes) & set(transfer_classes):
            raise ConfigError(f"classes and transfer_classes overlap: {sorted(set(classes) & set(transfer_classes))}")
        self.partition = partition if partition is not None else Shards(2)
        self.classes, self.holdout_clients = classes, holdout_clients
        self.transfer_classes, self.transfer_clients = transfer_classes, transfer_clients
        self.transfer_partition = transfer_partition
        self.write_report = write_report
        self.new_clients: FederatedData | None = None
        self.group_names: list[str] | None = None
        self.client_groups: list[str] | None = None
        self._reported = False

    # ---- to implement ----------------------------------------------------------------------------------
    def load(self) -> Pools:
        raise NotImplementedError

    # ---- build -----------------------------------------------------------------------------------------
    def build(self) -> FederatedData:
        pools = self.load()
        for name, cls in (("classes", self.classes), ("transfer_classes", self.transfer_classes)):
            bad = [c for c in cls or [] if not 0 <= c < pools.num_classes]
            if bad:
                raise ConfigError(f"{type(self).__name__}.{name}: {bad} not in 0..{pools.num_classes - 1}")
        new_pools = None
        if self.transfer_classes:
            new_pools = _select_classes(pools, self.transfer_classes)
            keep = self.classes or [c for c in range(pools.num_classes) if c not in set(self.transfer_classes)]
            pools = _select_classes(pools, keep)
        elif self.classes:
            pools = _select_classes(pools, self.classes)
        num_classes = max(pools.num_classes, new_pools.num_classes if new_pools else 0)

        total = self.num_clients + self.holdout_clients
        parts = partition_pools(
            self.partition, pools.x_train, pools.y_train, pools.x_test, pools.y_test, total, self.rng(1),
            pools.g_train, pools.g_test,
        )  # fmt: skip
        x_tr, y_tr, train_sets, x_te, y_te, test_sets = parts
        self.group_names = pools.group_names
        owners = None
        if pools.g_train is not None:  # each client's natural owner: the owner of its first training sample
            g_pool = pools.g_train
            if self.partition.pooled and pools.g_test is not None:
                g_pool = torch.cat([pools.g_train, pools.g_test])
            owners = torch.tensor([int(g_pool[s[0]]) if len(s) else -1 for s in train_sets], dtype=torch.long)
        if self.holdout_clients:
            order = self.rng(2).permutation(total)
            stay, leave = np.sort(order[: self.num_clients]), np.sort(order[self.num_clients :])
            self.new_clients = self._federated(
                x_tr, y_tr, [train_sets[i] for i in leave], x_te, y_te, [test_sets[i] for i in leave], num_classes,
                pools.augment, "held-out",
            )  # fmt: skip
            train_sets, test_sets = [train_sets[i] for i in stay], [test_sets[i] for i in stay]
            owners = None if owners is None else owners[torch.as_tensor(stay)]
        if new_pools is not None:
            partition = self.transfer_partition or Shards(len(self.transfer_classes))
            nx_tr, ny_tr, ntr, nx_te, ny_te, nte = partition_pools(
                partition, new_pools.x_train, new_pools.y_train, new_pools.x_test, new_pools.y_test,
                self.transfer_clients, self.rng(3), new_pools.g_train, new_pools.g_test,
            )  # fmt: skip
            self.new_clients = self._federated(nx_tr, ny_tr, ntr, nx_te, ny_te, nte, num_classes, pools.augment, "new")
        fed = self._federated(x_tr, y_tr, train_sets, x_te, y_te, test_sets, num_classes, pools.augment, "")
        if owners is not None:
            fed.extras["group"] = owners
            self.client_groups = [self.group_names[int(g)] if self.group_names else str(int(g)) for g in owners]
        return fed

    def _federated(self, x_tr, y_tr, tr, x_te, y_te, te, num_classes, augment, what) -> FederatedData:
        try:
            return self.make_federated(x_tr, y_tr, tr, x_te, y_te, te, num_classes, augment=augment)
        except ConfigError as exc:
            raise ConfigError(f"{what + ' clients: ' if what else ''}{exc} (empty client after partitioning)") from None

    # ---- report ----------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        trainer = getattr(self, "trainer", None)
        if self.write_report and not self._reported and trainer is not None and trainer.loggers:
            from datamodules.partition_report import log_report, write_report

            if trainer.is_global_zero:
                paths = write_report(self, Path(trainer.default_root_dir) / "partition")
                log_report(self, trainer.loggers, paths)
            self._reported = True
