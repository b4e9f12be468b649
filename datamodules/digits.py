"""scikit-learn's bundled 8×8 handwritten digits (1,797 images, 10 classes): real data, no download."""

from __future__ import annotations

import numpy as np
import torch

from datamodules.base import FederatedDataModule
from datamodules.partition import Partitioner, Shards
from fl_lightning.engine.client_data import FederatedData

#: the bundled digits as tensors, read once per process (scikit-learn parses its compressed CSV at every call)
_DIGITS: tuple[torch.Tensor, torch.Tensor] | None = None


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as ``[1797, 1, 8, 8]`` floats in [0, 1] and labels as ``[1797]`` longs (the caller's own copies)."""
    global _DIGITS
    if _DIGITS is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
        _DIGITS = x, torch.tensor(bunch.target, dtype=torch.long)
    x, y = _DIGITS
    return x.clone(), y.clone()


def stratified_split(y: np.ndarray, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    train, test = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


class DigitsDataModule(FederatedDataModule):
    """Digits split into a train/test pool (stratified), then partitioned over clients.

    Args:
        partition: how to split the pool over clients (default: 2-class shards).
        test_fraction: fraction of each class held out for client test sets.
        val_fraction: fraction of every client's training rows carved into ``federated.val``.
    """

    def __init__(
        self,
        num_clients: int = 20,
        partition: Partitioner | None = None,
        test_fraction: float = 0.2,
        clients_per_round: int | None = None,
        participation: float | None = 0.2,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed, val_fraction)
        self.partition = partition if partition is not None else Shards(2)
        self.test_fraction = test_fraction

    def build(self) -> FederatedData:
        x, y = load_digits_tensors()
        tr, te = stratified_split(y.numpy(), self.test_fraction, self.rng(0))
        train_sets, test_sets = self.partition(y[tr], y[te], self.num_clients, self.rng(1))
        return self.make_federated(x[tr], y[tr], train_sets, x[te], y[te], test_sets, num_classes=10)
