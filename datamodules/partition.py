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
    """Base class: ``__call__(train_labels, test_labels, num_clients, rng) -> (train_sets, test_sets)``.

    ``pooled``: the data module merges the train and test pools before calling (the partitioner makes the
    per-client test sets itself). ``uses_groups``: it also gets ``train_groups``/``test_groups``, each
    sample's natural owner. Use :func:`partition_pools` to apply any partitioner.
    """

    pooled: bool = False
    uses_groups: bool = False

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
        bad, changed = [], True
        for _ in range(100 * num_clients * s):  # repair rows with a repeated class by random swaps
            if changed:  # rows only change after a swap
                bad = [i for i in range(num_clients) if len(set(labels[i])) < s]
                changed = False
            if not bad:
                break
            i = bad[0]
            col = next(j for j in range(s) if list(labels[i]).count(labels[i, j]) > 1)
            k, col2 = rng.integers(num_clients), rng.integers(s)
            a, b = labels[i, col], labels[k, col2]
            if k != i and b not in labels[i] and a not in labels[k]:
                labels[i, col], labels[k, col2] = b, a
                changed = True
        if any(len(set(row)) < s for row in labels):  # no random repair found: a valid cyclic layout
            labels = (np.arange(num_clients)[:, None] * s + np.arange(s)[None, :]) % c
            labels = rng.permutation(c)[labels][rng.permutation(num_clients)]
        return classes[labels]

    def __call__(self, train_labels, test_labels, num_clients, rng):
        y_tr, y_te = train_labels.numpy(), test_labels.numpy()
        classes = np.unique(y_tr)
        per_class = num_clients * self.classes_per_client // max(len(classes), 1)
        for c in classes:  # capacity first: fail fast, before the class assignment
            if (y_tr == c).sum() < per_class:
                raise ConfigError(
                    f"Shards: class {c} has {(y_tr == c).sum()} training samples, too few to fill {per_class} shards "
                    f"(num_clients·S/classes = {num_clients}·{self.classes_per_client}/{len(classes)})"
                )
        assignment = self.assign_classes(num_clients, classes, rng)
        train_shards, test_shards = {}, {}
        for c in classes:
            tr, te = rng.permutation(np.flatnonzero(y_tr == c)), rng.permutation(np.flatnonzero(y_te == c))
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


# ---- pooled partitions, natural users, quantity skew -------------------------------------------------------
#
# A partitioner with ``pooled = True`` does not keep the dataset's own train/test split: the data module
# merges both pools and the partitioner cuts every client's samples into train and test itself
# (``test_fraction``). ``uses_groups = True`` means it needs each sample's natural owner (a LEAF user,
# an Omniglot alphabet), passed as ``train_groups``/``test_groups``.


def split_clients(
    sets: IndexSets, test_fraction: float, rng: np.random.Generator, labels: Tensor | None = None
) -> tuple[IndexSets, IndexSets]:
    """Cut every client's indices into train and test: ``round(test_fraction·m)`` test samples.

    With ``labels`` the cut is made per class (stratified). Any group of m ≥ 2 samples keeps at least one
    sample on each side when ``test_fraction > 0``.
    """
    y = None if labels is None else labels.numpy()
    train, test = [], []
    for s in sets:
        s = np.asarray(s, dtype=np.int64)
        parts = [s] if y is None else [s[y[s] == c] for c in np.unique(y[s])]
        tr_i, te_i = [], []
        for part in parts:
            part = rng.permutation(part)
            n_test = int(round(test_fraction * len(part)))
            if test_fraction > 0 and len(part) >= 2:
                n_test = min(max(n_test, 1), len(part) - 1)
            te_i.append(part[:n_test])
            tr_i.append(part[n_test:])
        train.append(np.concatenate(tr_i) if tr_i else np.zeros(0, np.int64))
        test.append(np.concatenate(te_i) if te_i else np.zeros(0, np.int64))
    return _as_tensors(train), _as_tensors(test)


class PerClientSplit(Partitioner):
    """Per-client train/test ratio: merge the pools, partition with ``partition``, then hold out
    ``test_fraction`` of every client's samples as its test set (stratified by class if ``stratify``)."""

    pooled = True

    def __init__(self, partition: Partitioner, test_fraction: float = 0.2, stratify: bool = False) -> None:
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"PerClientSplit.test_fraction must be in [0, 1), got {test_fraction}")
        self.partition, self.test_fraction, self.stratify = partition, test_fraction, stratify
        self.uses_groups = getattr(partition, "uses_groups", False)

    def __call__(self, train_labels, test_labels, num_clients, rng, train_groups=None, test_groups=None):
        kw = {"train_groups": train_groups, "test_groups": train_groups[:0]} if self.uses_groups else {}
        sets, _ = self.partition(train_labels, train_labels[:0], num_clients, rng, **kw)
        return split_clients(sets, self.test_fraction, rng, train_labels if self.stratify else None)


class Natural(Partitioner):
    """Natural clients (LEAF users, Omniglot alphabets): every sample stays with its owner.

    1. ``min_samples``: keep only owners with at least this many samples (train + test), e.g. Sent140's
       users with ≥ 50 tweets (spec 000 §3.2).
    2. If more owners remain than needed, draw ``num_clients / clients_per_group`` of them uniformly
       without replacement (Sent140's random 183 users); otherwise use them all, in id order.
    3. ``clients_per_group`` > 1 cuts each owner's samples into that many clients, class by class, so every
       client of an alphabet sees all its characters (PerFedSI Omniglot M = 200, 500; spec 002 §4.2).
       ``None`` means 1 if there are at least ``num_clients`` owners, else ``num_clients / owners``.
    4. ``test_fraction`` ``None`` keeps the dataset's own per-owner train/test files; a number merges them
       and re-splits every client (stratified by class if ``stratify``).
    """

    uses_groups = True

    def __init__(
        self,
        min_samples: int = 0,
        clients_per_group: int | None = None,
        test_fraction: float | None = None,
        stratify: bool = False,
    ) -> None:
        if test_fraction is not None and not 0 <= test_fraction < 1:
            raise ConfigError(f"Natural.test_fraction must be in [0, 1), got {test_fraction}")
        if clients_per_group is not None and clients_per_group < 1:
            raise ConfigError(f"Natural.clients_per_group must be ≥ 1, got {clients_per_group}")
        self.min_samples, self.clients_per_group = min_samples, clients_per_group
        self.test_fraction, self.stratify = test_fraction, stratify

    @property
    def pooled(self) -> bool:  # type: ignore[override]
        return self.test_fraction is not None

    def __call__(self, train_labels, test_labels, num_clients, rng, train_groups=None, test_groups=None):
        if train_groups is None:
            raise ConfigError("Natural partition needs a dataset with natural owners (LEAF users, Omniglot alphabets)")
        g_tr = train_groups.numpy()
        g_te = test_groups.numpy() if test_groups is not None else np.zeros(0, np.int64)
        counts = np.bincount(
            np.concatenate([g_tr, g_te]), minlength=int(max(g_tr.max(initial=-1), g_te.max(initial=-1)) + 1)
        )
        eligible = np.flatnonzero(counts >= max(self.min_samples, 1))
        k = self.clients_per_group
        if k is None:
            k = 1 if num_clients <= len(eligible) else max(1, num_clients // max(len(eligible), 1))
        if num_clients % k:
            raise ConfigError(f"Natural: num_clients={num_clients} is not a multiple of clients_per_group={k}")
        n_groups = num_clients // k
        if n_groups > len(eligible):
            raise ConfigError(
                f"Natural: only {len(eligible)} owners have ≥ {self.min_samples} samples, but num_clients="
                f"{num_clients} needs {n_groups} (clients_per_group={k}); lower num_clients or min_samples"
            )
        chosen = eligible if n_groups == len(eligible) else np.sort(rng.choice(eligible, n_groups, replace=False))
        y_tr, y_te = train_labels.numpy(), test_labels.numpy()
        train_sets, test_sets = [], []
        for g in chosen:
            for sets, idx, y in (
                (train_sets, np.flatnonzero(g_tr == g), y_tr),
                (test_sets, np.flatnonzero(g_te == g), y_te),
            ):
                if k == 1:
                    sets.append(idx)
                    continue
                parts = [[] for _ in range(k)]
                for c in np.unique(y[idx]):
                    for j, chunk in enumerate(np.array_split(rng.permutation(idx[y[idx] == c]), k)):
                        parts[j].extend(chunk.tolist())
                sets.extend(parts)
        if self.test_fraction is not None:
            merged = [np.concatenate([a, np.asarray(b, np.int64)]) for a, b in zip(train_sets, test_sets)]
            return split_clients(merged, self.test_fraction, rng, train_labels if self.stratify else None)
        return _as_tensors(train_sets), _as_tensors(test_sets)


class LogNormal(Partitioner):
    """Quantity skew with consecutive classes: FedRep's FEMNIST partition (spec 000 §3.2, §8.2).

    Recipe (our exact version of the FedDANE/FedRep sampler): client i holds the S = ``classes_per_client``
    classes ``(i + j) mod C``, j < S. Its total size is ``min_samples + e_i`` with
    ``e_i ∝ X_i − min_j X_j``, ``X_i ~ LogNormal(mu, sigma)``, rescaled so that
    Σ e_i = n·(``mean_samples`` − ``min_samples``) (largest-remainder rounding). So the mean is exactly
    ``mean_samples`` (when n·mean is an integer), the smallest client has exactly ``min_samples``, and the
    skew is that of lognormal(4, 1). A client's samples are
    split evenly over its S classes and drawn without replacement; then ``test_fraction`` of them (FedRep:
    10 %) become its test set. The dataset's own train/test files are merged first (``pooled``).
    """

    pooled = True

    def __init__(
        self,
        classes_per_client: int = 3,
        mean_samples: float = 148.0,
        min_samples: int = 50,
        mu: float = 4.0,
        sigma: float = 1.0,
        test_fraction: float = 0.1,
    ) -> None:
        if classes_per_client < 1 or min_samples < 0 or mean_samples < min_samples or sigma < 0:
            raise ConfigError(
                "LogNormal needs classes_per_client ≥ 1, sigma ≥ 0 and 0 ≤ min_samples ≤ mean_samples, got "
                f"{classes_per_client}, {sigma}, {min_samples}, {mean_samples}"
            )
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"LogNormal.test_fraction must be in [0, 1), got {test_fraction}")
        self.classes_per_client, self.mean_samples, self.min_samples = classes_per_client, mean_samples, min_samples
        self.mu, self.sigma, self.test_fraction = mu, sigma, test_fraction

    def sizes(self, num_clients: int, rng: np.random.Generator) -> np.ndarray:
        """Per-client total sample counts (before the train/test cut)."""
        x = rng.lognormal(self.mu, self.sigma, num_clients)
        x = x - x.min()  # the smallest client sits exactly at min_samples
        if x.sum() == 0:
            x = np.ones(num_clients)
        extra_total = int(round(num_clients * (self.mean_samples - self.min_samples)))
        raw = x / x.sum() * extra_total
        extra = np.floor(raw).astype(np.int64)
        extra[np.argsort(-(raw - extra), kind="stable")[: extra_total - int(extra.sum())]] += 1
        return self.min_samples + extra

    def __call__(self, train_labels, test_labels, num_clients, rng, train_groups=None, test_groups=None):
        y = train_labels.numpy()
        classes = np.unique(y)
        s, c = self.classes_per_client, len(classes)
        if s > c:
            raise ConfigError(f"LogNormal: {s} classes per client but the data have only {c} classes")
        sizes = self.sizes(num_clients, rng)
        pools = {k: rng.permutation(np.flatnonzero(y == k)) for k in classes}
        used = dict.fromkeys(classes, 0)
        sets = []
        for i, size in enumerate(sizes):
            parts = []
            for j, m in enumerate(np.array_split(np.arange(size), s)):
                k = classes[(i + j) % c]
                parts.append(pools[k][used[k] : used[k] + len(m)])
                used[k] += len(m)
                if used[k] > len(pools[k]):
                    raise ConfigError(
                        f"LogNormal: class {k} has {len(pools[k])} samples, too few for {num_clients} clients of "
                        f"mean size {self.mean_samples}; lower mean_samples or num_clients"
                    )
            sets.append(np.concatenate(parts))
        return split_clients(sets, self.test_fraction, rng)


def partition_pools(
    partition: Partitioner,
    x_train: Tensor,
    y_train: Tensor,
    x_test: Tensor,
    y_test: Tensor,
    num_clients: int,
    rng: np.random.Generator,
    g_train: Tensor | None = None,
    g_test: Tensor | None = None,
) -> tuple[Tensor, Tensor, IndexSets, Tensor, Tensor, IndexSets]:
    """Apply ``partition``; returns ``(x_tr, y_tr, train_sets, x_te, y_te, test_sets)`` for ``make_federated``.

    For a ``pooled`` partitioner both returned pools are the merged train+test pool.
    """
    if partition.pooled:
        x_train, y_train = torch.cat([x_train, x_test]), torch.cat([y_train, y_test])
        g_train = None if g_train is None else torch.cat([g_train, g_test if g_test is not None else g_train[:0]])
        x_test, y_test, g_test = x_train, y_train, None if g_train is None else g_train[:0]
        kw = {"train_groups": g_train, "test_groups": g_test} if partition.uses_groups else {}
        train_sets, test_sets = partition(y_train, y_train, num_clients, rng, **kw)
    else:
        kw = {"train_groups": g_train, "test_groups": g_test} if partition.uses_groups else {}
        train_sets, test_sets = partition(y_train, y_test, num_clients, rng, **kw)
    return x_train, y_train, train_sets, x_test, y_test, test_sets
