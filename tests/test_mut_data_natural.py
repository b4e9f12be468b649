"""``Natural`` (every sample stays with its natural owner), ``partition_pools`` around pooled/grouped partitions,
and ``Shards.assign_classes``'s cyclic fallback layout. Expected owners, counts and layouts are counted by hand
from the tiny inputs written in each test."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch import Tensor

from datamodules.partition import Natural, Partitioner, Shards, partition_pools
from fl_lightning.errors import ConfigError


def _owners(sets: list[Tensor], groups: Tensor) -> list[set[int]]:
    return [set(groups[s].tolist()) for s in sets]


# ---- Natural: constructor ranges and defaults -------------------------------------------------------------


def test_natural_test_fraction_edges() -> None:
    assert Natural(test_fraction=0.0).test_fraction == 0.0  # 0 is inside [0, 1)
    assert Natural(test_fraction=0.5).pooled
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match="test_fraction"):
            Natural(test_fraction=bad)


def test_natural_clients_per_group_edges() -> None:
    assert Natural(clients_per_group=1).clients_per_group == 1
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="clients_per_group"):
            Natural(clients_per_group=bad)


def test_natural_defaults() -> None:
    nat = Natural()
    assert nat.min_samples == 0
    assert nat.stratify is False
    assert nat.clients_per_group is None and nat.test_fraction is None
    assert not nat.pooled


# ---- Natural: which owners are eligible -------------------------------------------------------------------


def test_owner_with_a_single_sample_is_eligible_by_default() -> None:
    """Owners 0 (one sample: index 0), 1 (indices 1, 2), 2 (index 3): all three have ≥ 1 sample, so three
    clients are exactly the three owners in id order; no test groups given means empty test sets."""
    groups = torch.tensor([0, 1, 1, 2])
    labels = torch.tensor([0, 1, 0, 1])
    train, test = Natural()(labels, labels[:0], 3, np.random.default_rng(0), groups)
    assert [t.tolist() for t in train] == [[0], [1, 2], [3]]
    assert [len(t) for t in test] == [0, 0, 0]


def test_without_test_groups_no_owner_gets_a_phantom_test_sample() -> None:
    """Owner 0 has 2 training samples and ``min_samples`` = 3: not eligible (a phantom test sample of owner 0
    would make it 3). Owners 1, 2 (3 samples each) are the two clients; test sets stay empty."""
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    labels = torch.zeros(8, dtype=torch.long)
    train, test = Natural(min_samples=3)(labels, labels[:0], 2, np.random.default_rng(0), groups)
    assert [t.tolist() for t in train] == [[2, 3, 4], [5, 6, 7]]
    assert [t.tolist() for t in test] == [[], []]
    with pytest.raises(ConfigError, match="only 2 owners"):
        Natural(min_samples=3)(labels, labels[:0], 3, np.random.default_rng(0), groups)


def test_owners_counted_over_train_and_test_pools() -> None:
    """Owner 0 holds no training sample but two test samples; owner 1 one of each. Both are eligible
    (≥ 1 sample in train ∪ test): client 0 = owner 0 (empty train set), client 1 = owner 1."""
    g_tr, g_te = torch.tensor([1]), torch.tensor([0, 1, 0])
    y_tr, y_te = torch.tensor([0]), torch.tensor([1, 0, 1])
    train, test = Natural()(y_tr, y_te, 2, np.random.default_rng(0), g_tr, g_te)
    assert [t.tolist() for t in train] == [[], [0]]
    assert [t.tolist() for t in test] == [[0, 2], [1]]


def test_all_samples_in_the_test_pool() -> None:
    """No training sample at all, two owners in the test pool: each client is one owner's test samples."""
    g_te = torch.tensor([0, 1, 1, 0])
    y_te = torch.tensor([0, 0, 1, 1])
    empty = torch.zeros(0, dtype=torch.long)
    train, test = Natural()(empty, y_te, 2, np.random.default_rng(0), empty, g_te)
    assert [t.tolist() for t in train] == [[], []]
    assert [t.tolist() for t in test] == [[0, 3], [1, 2]]


def test_no_owners_at_all_is_a_config_error() -> None:
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ConfigError, match="only 0 owners"):
        Natural()(empty, empty, 2, np.random.default_rng(0), empty, empty)


def test_using_every_owner_draws_nothing_from_the_generator() -> None:
    """All owners are needed (one client each): they are taken in id order without a random draw, so the
    generator's stream is untouched for what follows (the same next draw as a fresh generator)."""
    groups = torch.tensor([2, 0, 1, 0])
    labels = torch.zeros(4, dtype=torch.long)
    rng = np.random.default_rng(5)
    train, _ = Natural()(labels, labels[:0], 3, rng, groups)
    assert [t.tolist() for t in train] == [[1, 3], [2], [0]]
    assert rng.integers(2**62) == np.random.default_rng(5).integers(2**62)


def test_more_owners_than_clients_draws_distinct_owners() -> None:
    groups = torch.arange(6).repeat_interleave(2)  # owners 0..5, two samples each
    labels = torch.zeros(12, dtype=torch.long)
    train, _ = Natural()(labels, labels[:0], 3, np.random.default_rng(1), groups)
    owners = _owners(train, groups)
    assert all(len(o) == 1 for o in owners)
    chosen = [next(iter(o)) for o in owners]
    assert len(set(chosen)) == 3 and chosen == sorted(chosen)
    assert all(len(t) == 2 for t in train)


# ---- Natural: clients per group ---------------------------------------------------------------------------


def test_explicit_clients_per_group_cuts_chosen_owners() -> None:
    """Four owners (4 samples each, classes 0, 0, 1, 1), ``clients_per_group`` = 2, four clients: two owners are
    drawn and each is cut into two clients of one sample per class (even with enough owners for one each)."""
    groups = torch.arange(4).repeat_interleave(4)
    labels = torch.tensor([0, 0, 1, 1] * 4)
    train, test = Natural(clients_per_group=2)(labels, labels[:0], 4, np.random.default_rng(0), groups)
    owners = _owners(train, groups)
    assert all(len(o) == 1 for o in owners)
    assert owners[0] == owners[1] and owners[2] == owners[3] and owners[0] != owners[2]
    assert [sorted(labels[t].tolist()) for t in train] == [[0, 1]] * 4
    flat = torch.cat(train).tolist()
    assert len(flat) == len(set(flat)) == 8
    assert [len(t) for t in test] == [0] * 4


# ---- Natural: re-split with test_fraction -----------------------------------------------------------------


def test_test_fraction_split_is_unstratified_by_default() -> None:
    """One owner with labels 0, 0, 1, 1 and ``test_fraction`` = 0.25: unstratified, round(0.25·4) = 1 test
    sample; stratified, each class of 2 keeps one on each side, so 2 test samples."""
    groups = torch.zeros(4, dtype=torch.long)
    labels = torch.tensor([0, 0, 1, 1])
    for nat, n_test in ((Natural(test_fraction=0.25), 1), (Natural(test_fraction=0.25, stratify=True), 2)):
        train, test = nat(labels, labels[:0], 1, np.random.default_rng(0), groups, groups[:0])
        assert len(test[0]) == n_test and len(train[0]) == 4 - n_test
        assert sorted(torch.cat([train[0], test[0]]).tolist()) == [0, 1, 2, 3]


def test_test_fraction_with_clients_per_group_keeps_integer_indices() -> None:
    """Owner 0 (labels 0, 1, 0, 1) cut into two clients, then each client re-split half/half: indices stay
    integer, disjoint and cover the owner."""
    groups = torch.zeros(4, dtype=torch.long)
    labels = torch.tensor([0, 1, 0, 1])
    train, test = Natural(clients_per_group=2, test_fraction=0.5)(
        labels, labels[:0], 2, np.random.default_rng(0), groups, groups[:0]
    )
    assert all(t.dtype == torch.int64 for t in [*train, *test])
    assert [len(t) for t in train] == [1, 1] and [len(t) for t in test] == [1, 1]
    assert sorted(torch.cat([*train, *test]).tolist()) == [0, 1, 2, 3]


# ---- partition_pools ------------------------------------------------------------------------------------


class _Recorder(Partitioner):
    """A pooled partition that uses groups: records what it was given, one client with every sample."""

    pooled = True
    uses_groups = True

    def __init__(self) -> None:
        self.kw: dict = {}

    def __call__(self, train_labels, test_labels, num_clients, rng, train_groups=None, test_groups=None):
        self.kw = {"train_groups": train_groups, "test_groups": test_groups}
        return [torch.arange(len(train_labels))], [torch.arange(0)]


class _PooledNoGroups(Partitioner):
    """A pooled partition without groups, whose call takes no group arguments."""

    pooled = True

    def __call__(self, train_labels, test_labels, num_clients, rng):
        return [torch.arange(len(train_labels))], [torch.arange(0)]


def test_pooled_partition_with_groups_gets_an_empty_test_group_tensor() -> None:
    x_tr, y_tr, x_te, y_te = torch.zeros(3, 2), torch.tensor([0, 1, 0]), torch.ones(2, 2), torch.tensor([1, 1])
    rec = _Recorder()
    out = partition_pools(
        rec, x_tr, y_tr, x_te, y_te, 1, np.random.default_rng(0), torch.tensor([0, 0, 1]), torch.tensor([1, 2])
    )
    assert rec.kw["train_groups"].tolist() == [0, 0, 1, 1, 2]
    assert isinstance(rec.kw["test_groups"], Tensor) and rec.kw["test_groups"].numel() == 0
    assert out[1].tolist() == [0, 1, 0, 1, 1] and out[4].tolist() == [0, 1, 0, 1, 1]


def test_pooled_partition_without_groups_is_called_without_group_arguments() -> None:
    x_tr, y_tr = torch.zeros(3, 2), torch.tensor([0, 1, 0])
    _, y, train_sets, _, _, _ = partition_pools(
        _PooledNoGroups(), x_tr, y_tr, x_tr[:1], y_tr[:1], 1, np.random.default_rng(0), torch.tensor([0, 0, 1])
    )
    assert y.tolist() == [0, 1, 0, 0] and train_sets[0].tolist() == [0, 1, 2, 3]


def test_pooled_natural_with_train_groups_only() -> None:
    """Groups for the training pool only and an empty test pool: owners 0 (indices 0, 1) and 1 (2, 3), each
    re-split half/half; every index is a real sample, each owner's pair is split across train and test."""
    x = torch.arange(8.0).reshape(4, 2)
    y = torch.tensor([0, 1, 0, 1])
    g = torch.tensor([0, 0, 1, 1])
    _, y_all, train_sets, _, _, test_sets = partition_pools(
        Natural(test_fraction=0.5), x, y, x[:0], y[:0], 2, np.random.default_rng(0), g, None
    )
    assert len(y_all) == 4
    pairs = [sorted(torch.cat([tr, te]).tolist()) for tr, te in zip(train_sets, test_sets)]
    assert pairs == [[0, 1], [2, 3]]
    assert [len(t) for t in train_sets] == [1, 1] and [len(t) for t in test_sets] == [1, 1]


# ---- Shards.assign_classes: the cyclic fallback ----------------------------------------------------------


class _NoRepairRng:
    """A stand-in generator: ``permutation`` reverses (identity on the initial class pool), and every swap
    proposal ``integers`` makes targets the bad row itself, so the random repair never succeeds."""

    def __init__(self) -> None:
        self.proposals = 0
        self.permutations = 0

    def permutation(self, x: int | np.ndarray) -> np.ndarray:
        self.permutations += 1
        if isinstance(x, (int, np.integer)):
            return np.arange(x)[::-1].copy()
        arr = np.asarray(x)
        if arr.ndim < 1:  # as numpy's Generator.permutation
            raise ValueError("x must be an integer or at least 1-dimensional")
        return arr.copy()

    def integers(self, high: int) -> int:
        self.proposals += 1
        return 0


def test_shards_falls_back_to_the_cyclic_layout_after_the_repair_budget() -> None:
    """n = 4 clients, S = 2, C = 4 classes [10, 20, 30, 40]: the initial pool [0,0,1,1,2,2,3,3] gives every row a
    repeated class, no swap is ever accepted, so after 100·n·S = 800 proposals (each two draws) the layout is
    cyclic: row i holds classes (2i + j) mod 4 → [[0,1],[2,3],[0,1],[2,3]], classes relabelled by the reversed
    permutation [3,2,1,0] → [[3,2],[1,0],[3,2],[1,0]], rows reordered by the reversed client permutation."""
    rng = _NoRepairRng()
    out = Shards(2).assign_classes(4, np.array([10, 20, 30, 40]), rng)  # type: ignore[arg-type]
    assert out.tolist() == [[20, 10], [40, 30], [20, 10], [40, 30]]
    assert rng.proposals == 2 * 100 * 4 * 2
    assert rng.permutations == 3
    assert all(len(set(r)) == 2 for r in out.tolist())
    assert Counter(out.ravel().tolist()) == {10: 2, 20: 2, 30: 2, 40: 2}


def test_shards_cyclic_fallback_with_three_classes_per_client() -> None:
    """n = 2, S = 3, C = 3: the pool [0,0,1,1,2,2] reshaped gives rows [0,0,1], [1,2,2]; no repair, so the cyclic
    layout (3i + j) mod 3 = [[0,1,2],[0,1,2]], relabelled [2,1,0] → [[2,1,0],[2,1,0]]."""
    rng = _NoRepairRng()
    out = Shards(3).assign_classes(2, np.array([5, 6, 7]), rng)  # type: ignore[arg-type]
    assert out.tolist() == [[7, 6, 5], [7, 6, 5]]
    assert rng.proposals == 2 * 100 * 2 * 3
