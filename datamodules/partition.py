"""Partitioners: split labelled samples into per-client train and test index sets.

Each partitioner is called with the train and test labels and a numpy ``Generator`` and returns two
lists of index tensors (one per client). Test sets follow each client's own train distribution.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fl_lightning.errors import ConfigError

IndexSets = list[Tensor]


class Partitioner:
    """Base class: ``__call__(train_labels, test_labels, num_clients, rng) -> (train_sets, test_sets)``."""

    def __call__(
        self, train_labels: Tensor, test_labels: Tensor, num_clients: int, rng: np.random.Generator
    ) -> tuple[IndexSets, IndexSets]:
        raise NotImplementedError


def _as_tensors(sets: list[list[int] | np.ndarray]) -> IndexSets:
    return [torch.as_tensor(np.sort(np.asarray(s, dtype=np.int64))) for s in sets]


class Shards(Partitioner):
    """McMahan-style shards (spec 000 §3.2): ``classes_per_client`` (S) single-class shards per client.

    Each class is split into ``S·n/C`` equal shards; every client receives S shards of S *distinct*
    classes. The test set is cut the same way and a client gets the test shards of its own classes.
    """

    def __init__(self, classes_per_client: int = 2) -> None:
        if classes_per_client < 1:
            raise ConfigError(f"Shards.classes_per_client must be ≥ 1, got {classes_per_client}")
        self.classes_per_client = classes_per_client

    def assign_classes(self, num_clients: int, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """An ``n×S`` class matrix, rows distinct, every class used exactly ``S·n/C`` times."""
        s, c = self.classes_per_client, len(classes)
        if s > c:
            raise ConfigError(f"Shards: {s} classes per client but the data have only {c} classes")
        if (num_clients * s) % c:
            raise ConfigError(
                f"Shards: num_clients·S = {num_clients}·{s} = {num_clients * s} shards do not divide evenly "
                f"over {c} classes; choose num_clients·S as a multiple of {c}"
            )
        labels = rng.permutation(np.repeat(np.arange(c), num_clients * s // c)).reshape(num_clients, s)
        for _ in range(100 * num_clients * s):  # repair rows with a repeated class by random swaps
            bad = [i for i in range(num_clients) if len(set(labels[i])) < s]
            if not bad:
                break
            i = bad[0]
            col = next(j for j in range(s) if list(labels[i]).count(labels[i, j]) > 1)
            k, col2 = rng.integers(num_clients), rng.integers(s)
            a, b = labels[i, col], labels[k, col2]
            if k != i and b not in labels[i] and a not in labels[k]:
                labels[i, col], labels[k, col2] = b, a
        return classes[labels]

    def __call__(self, train_labels, test_labels, num_clients, rng):
        y_tr, y_te = train_labels.numpy(), test_labels.numpy()
        classes = np.unique(y_tr)
        per_class = num_clients * self.classes_per_client // max(len(classes), 1)
        assignment = self.assign_classes(num_clients, classes, rng)
        train_shards, test_shards = {}, {}
        for c in classes:
            tr, te = rng.permutation(np.flatnonzero(y_tr == c)), rng.permutation(np.flatnonzero(y_te == c))
            if len(tr) < per_class:
                raise ConfigError(
                    f"Shards: class {c} has {len(tr)} training samples, too few to fill {per_class} shards "
                    f"(num_clients·S/classes = {num_clients}·{self.classes_per_client}/{len(classes)})"
                )
            train_shards[c], test_shards[c] = np.array_split(tr, per_class), np.array_split(te, per_class)
        used = {c: 0 for c in classes}
        train_sets, test_sets = [], []
        for row in assignment:
            tr_i, te_i = [], []
            for c in row:
                tr_i.append(train_shards[c][used[c]])
                te_i.append(test_shards[c][used[c]])
                used[c] += 1
            train_sets.append(np.concatenate(tr_i))
            test_sets.append(np.concatenate(te_i))
        return _as_tensors(train_sets), _as_tensors(test_sets)


class Dirichlet(Partitioner):
    """Label skew: each class is spread over clients with proportions ``p ~ Dir(α·1ₙ)``.

    Small α concentrates every class on few clients; large α is near-uniform. The test set of each
    class is split with the same proportions. Redraws until every client has ``min_samples`` samples.
    """

    def __init__(self, alpha: float = 0.5, min_samples: int = 2, max_tries: int = 100) -> None:
        if alpha <= 0:
            raise ConfigError(f"Dirichlet.alpha must be positive, got {alpha}")
        self.alpha, self.min_samples, self.max_tries = alpha, min_samples, max_tries

    def __call__(self, train_labels, test_labels, num_clients, rng):
        y_tr, y_te = train_labels.numpy(), test_labels.numpy()
        for _ in range(self.max_tries):
            train_sets = [[] for _ in range(num_clients)]
            test_sets = [[] for _ in range(num_clients)]
            for c in np.unique(y_tr):
                p = rng.dirichlet(np.full(num_clients, self.alpha))
                for sets, idx in ((train_sets, np.flatnonzero(y_tr == c)), (test_sets, np.flatnonzero(y_te == c))):
                    idx = rng.permutation(idx)
                    cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
                    for i, part in enumerate(np.split(idx, cuts)):
                        sets[i].extend(part.tolist())
            if min(len(s) for s in train_sets) >= self.min_samples:
                return _as_tensors(train_sets), _as_tensors(test_sets)
        raise ConfigError(
            f"Dirichlet(alpha={self.alpha}): no draw in {self.max_tries} tries gave every one of {num_clients} "
            f"clients at least {self.min_samples} samples; raise alpha or lower num_clients"
        )
