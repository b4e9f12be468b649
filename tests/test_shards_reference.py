"""``Shards`` against an independent statement of its algorithm (spec 000 §3.2), seed for seed.

The reference below is written from the docstrings: the class matrix is a random permutation of every class
repeated S·n/C times, rows with a repeated class repaired by random swaps (row i's first repeated column
against a random cell of a random other row, taken when neither row then holds a class twice; at most
100·n·S tries), else a cyclic layout under random relabelling; each class's rows are permuted and cut into
S·n/C shards, dealt to the rows that name the class in row order, the same shard number for train and test.
Also pinned: the constructor's default and range, the capacity check, ``_as_tensors``' int64 index sets, and
``PerClientSplit`` handing its partition no test owners."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.partition import Natural, PerClientSplit, Shards, _as_tensors
from fl_lightning.errors import ConfigError


def ref_assign(n: int, s: int, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    c = len(classes)
    lab = rng.permutation(np.repeat(np.arange(c), n * s // c)).reshape(n, s)
    for _ in range(100 * n * s):
        bad = [i for i in range(n) if len(set(lab[i].tolist())) < s]
        if not bad:
            break
        i = bad[0]
        row = lab[i].tolist()
        col = [j for j in range(s) if row.count(row[j]) > 1][0]
        k, col2 = rng.integers(n), rng.integers(s)
        a, b = lab[i, col], lab[k, col2]
        if k != i and b not in lab[i] and a not in lab[k]:
            lab[i, col], lab[k, col2] = b, a
    if any(len(set(r.tolist())) < s for r in lab):
        cyc = np.array([[(i * s + j) % c for j in range(s)] for i in range(n)])
        lab = rng.permutation(c)[cyc][rng.permutation(n)]
    return classes[lab]


def ref_shards(y_tr: np.ndarray, y_te: np.ndarray, n: int, s: int, seed: int) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    classes = np.unique(y_tr)
    per_class = n * s // len(classes)
    assignment = ref_assign(n, s, classes, rng)
    tr_sh, te_sh = {}, {}
    for c in classes:
        tr, te = rng.permutation(np.flatnonzero(y_tr == c)), rng.permutation(np.flatnonzero(y_te == c))
        tr_sh[c], te_sh[c] = np.array_split(tr, per_class), np.array_split(te, per_class)
    dealt = {c: 0 for c in classes}
    train, test = [], []
    for row in assignment:
        train.append(sorted(int(i) for c in row for i in tr_sh[c][dealt[c]]))
        test.append(sorted(int(i) for c in row for i in te_sh[c][dealt[c]]))
        for c in row:
            dealt[c] += 1
    return train, test


@pytest.mark.parametrize(("n", "s", "c"), [(4, 4, 4), (6, 2, 4), (5, 2, 5), (3, 3, 3), (8, 3, 6)])
@pytest.mark.parametrize("seed", [0, 1, 41, 43, 48])  # 41, 43, 48: (4, 4, 4) needs the cyclic layout
def test_assign_classes_matches_the_reference(n: int, s: int, c: int, seed: int) -> None:
    classes = np.arange(c) * 3 + 2  # labels that are not 0..C-1
    got = Shards(s).assign_classes(n, classes, np.random.default_rng(seed))
    want = ref_assign(n, s, classes, np.random.default_rng(seed))
    assert got.shape == (n, s)
    np.testing.assert_array_equal(got, want)
    assert all(len(set(r.tolist())) == s for r in got)


@pytest.mark.parametrize(("n", "s", "seed"), [(6, 2, 0), (6, 2, 7), (4, 4, 41), (8, 3, 5)])
def test_shards_partition_matches_the_reference(n: int, s: int, seed: int) -> None:
    gen = np.random.default_rng(100 + seed)
    num_classes = {2: 4, 4: 4, 3: 6}[s]
    y_tr = gen.permutation(np.repeat(np.arange(num_classes), 9))
    y_te = gen.permutation(np.repeat(np.arange(num_classes), 5))
    train, test = Shards(s)(torch.as_tensor(y_tr), torch.as_tensor(y_te), n, np.random.default_rng(seed))
    want_tr, want_te = ref_shards(y_tr, y_te, n, s, seed)
    assert [t.tolist() for t in train] == want_tr
    assert [t.tolist() for t in test] == want_te
    assert all(t.dtype == torch.long for t in train + test)


def test_single_class_single_shard_per_client() -> None:
    """C = 1, S = 1: the one class is cut into n shards, one per client (disjoint, covering)."""
    y = torch.zeros(8, dtype=torch.long)
    train, test = Shards(1)(y, y[:4], 4, np.random.default_rng(0))
    assert sorted(i for t in train for i in t.tolist()) == list(range(8))
    assert [len(t) for t in train] == [2, 2, 2, 2]
    assert sorted(i for t in test for i in t.tolist()) == list(range(4))


def test_constructor_default_and_range() -> None:
    assert Shards().classes_per_client == 2
    assert Shards(1).classes_per_client == 1
    with pytest.raises(ConfigError, match="classes_per_client"):
        Shards(0)


def test_a_class_too_small_for_its_shards_is_refused() -> None:
    """6 clients · 1 class / 3 classes = 2 shards per class; class 0 has one sample."""
    y = torch.tensor([0] + [1] * 50 + [2] * 50)
    with pytest.raises(ConfigError, match="too few"):
        Shards(1)(y, y, 6, np.random.default_rng(0))


def test_uneven_shard_count_reports_divisibility_not_capacity() -> None:
    """3 clients · 1 / 2 classes = 1.5 shards: every class has ≥ 1 sample, so the error is divisibility."""
    y = torch.tensor([0, 1, 1, 1])
    with pytest.raises(ConfigError, match="divide evenly"):
        Shards(1)(y, y, 3, np.random.default_rng(0))


def test_index_sets_are_sorted_int64_even_when_empty() -> None:
    sets = _as_tensors([[], [3, 1, 2], np.array([], dtype=np.int32)])
    assert [t.dtype for t in sets] == [torch.long] * 3
    assert [t.tolist() for t in sets] == [[], [1, 2, 3], []]


def test_per_client_split_gives_its_partition_no_test_owners() -> None:
    """Natural(min_samples=3) inside PerClientSplit: owner 0 (2 samples) is not eligible, owners 1 and 2 are
    the clients; no test pool may add to owner 0's count."""
    labels = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    groups = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    split = PerClientSplit(Natural(min_samples=3), test_fraction=0.25)
    train, test = split(labels, labels[:0], 2, np.random.default_rng(0), train_groups=groups, test_groups=None)
    owned = [sorted(a.tolist() + b.tolist()) for a, b in zip(train, test)]
    assert owned == [[2, 3, 4, 5], [6, 7, 8, 9]]


def test_per_client_split_counts_no_phantom_test_sample_towards_an_owner() -> None:
    """Owner 0 has 2 < min_samples = 3 samples and no test pool: only 2 owners qualify, so 3 clients are refused."""
    labels = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 0, 1])
    groups = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    split = PerClientSplit(Natural(min_samples=3), test_fraction=0.25)
    with pytest.raises(ConfigError, match="only 2 owners"):
        split(labels, labels[:0], 3, np.random.default_rng(0), train_groups=groups, test_groups=None)
