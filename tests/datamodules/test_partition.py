"""``datamodules/partition.py``: every partitioner and splitter against the promises a partition makes and against
independent statements of its algorithm (Shards, Dirichlet, LogNormal, Natural, PerClientSplit, ``split_clients``)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch import Tensor

from datamodules import (
    CIFAR10DataModule,
    DigitsDataModule,
    FeatureShift,
    FEMNISTDataModule,
    IIDSplit,
    LogNormal,
    PerClientSplit,
)
from datamodules.digits import load_digits_tensors
from datamodules.partition import Dirichlet, Natural, Partitioner, Shards, _as_tensors, partition_pools, split_clients
from fl_lightning.errors import ConfigError
from tests.helpers.data_fixtures import write_cifar10, write_femnist


def _owners(sets: list[Tensor], groups: Tensor) -> list[set[int]]:
    return [set(groups[s].tolist()) for s in sets]


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


def test_stratified_split_of_an_empty_client_gives_empty_long_sets() -> None:
    labels = torch.tensor([0, 1, 0, 1])
    train, test = split_clients([[], [0, 1, 2, 3]], 0.5, np.random.default_rng(0), labels)
    assert train[0].tolist() == [] and test[0].tolist() == []
    assert train[0].dtype == torch.long and test[0].dtype == torch.long
    # client 1: one of each class goes to test (round(0.5 · 2) = 1 per class)
    assert sorted(labels[test[1]].tolist()) == [0, 1] and sorted(labels[train[1]].tolist()) == [0, 1]
    assert sorted(train[1].tolist() + test[1].tolist()) == [0, 1, 2, 3]


def test_unstratified_split_of_an_empty_list_client() -> None:
    train, test = split_clients([[]], 0.5, np.random.default_rng(0))
    assert train[0].tolist() == [] and test[0].tolist() == []


def test_a_fraction_rounding_to_every_sample_still_keeps_one_for_training() -> None:
    """0.9 · 2 rounds to 2; two samples keep one on each side. With 3 samples 0.9 · 3 → 3 is capped to 2."""
    train, test = split_clients([[5, 6], [7, 8, 9]], 0.9, np.random.default_rng(0))
    assert [len(t) for t in train] == [1, 1] and [len(t) for t in test] == [1, 2]
    assert sorted(train[0].tolist() + test[0].tolist()) == [5, 6]
    assert sorted(train[1].tolist() + test[1].tolist()) == [7, 8, 9]


class _ScriptedRng:
    """Hands out scripted Dirichlet proportions (the last one repeats) and identity permutations."""

    def __init__(self, draws: list[list[float]]) -> None:
        self.draws, self.alphas = draws, []

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        self.alphas.append(np.asarray(alpha).tolist())
        return np.asarray(self.draws[min(len(self.alphas) - 1, len(self.draws) - 1)])

    def permutation(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)


def test_dirichlet_defaults_alpha_half_and_two_samples_per_client() -> None:
    """One class of 4 samples, 2 clients. p = (0.9, 0.1) cuts at ⌊3.6⌋ = 3: sizes 3, 1 < 2, redrawn;
    p = (0.5, 0.5) gives 2, 2: accepted with the default ``min_samples`` = 2."""
    rng = _ScriptedRng([[0.9, 0.1], [0.5, 0.5]])
    y = torch.zeros(4, dtype=torch.long)
    train, test = Dirichlet()(y, y[:0], 2, rng)  # type: ignore[arg-type]
    assert [t.tolist() for t in train] == [[0, 1], [2, 3]]
    assert [len(t) for t in test] == [0, 0]
    assert rng.alphas == [[0.5, 0.5], [0.5, 0.5]]


def test_dirichlet_default_gives_up_after_100_draws() -> None:
    rng = _ScriptedRng([[1.0, 0.0]])  # client 1 never gets a sample
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigError, match="no draw in 100 tries"):
        Dirichlet()(y, y[:0], 2, rng)  # type: ignore[arg-type]
    assert len(rng.alphas) == 100


def labels(per_class: list[int], seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.permutation(np.repeat(np.arange(len(per_class)), per_class)))


def histogram(y: torch.Tensor, idx: torch.Tensor, num_classes: int) -> np.ndarray:
    return np.bincount(y[idx].numpy(), minlength=num_classes)


def check_clients_disjoint(sets: list[torch.Tensor], pool_size: int, what: str) -> set[int]:
    """Each client's indices are unique and in range, and no index belongs to two clients; returns their union."""
    seen: set[int] = set()
    for c, s in enumerate(sets):
        idx = s.tolist()
        assert len(idx) == len(set(idx)), f"{what}: client {c} holds an index twice"
        assert all(0 <= i < pool_size for i in idx), f"{what}: client {c} has an index outside 0..{pool_size - 1}"
        shared = seen & set(idx)
        assert not shared, f"{what}: client {c} shares {sorted(shared)[:5]} with an earlier client"
        seen |= set(idx)
    return seen


def check_partition(train, test, n_train: int, n_test: int, *, pooled: bool, covers: bool) -> None:
    """Disjoint clients; for a pooled partitioner (train and test index one merged pool) disjoint train/test;
    with ``covers`` every sample of the pool(s) is used."""
    assert len(train) == len(test)
    used_train = check_clients_disjoint(train, n_train, "train")
    used_test = check_clients_disjoint(test, n_test, "test")
    if pooled:
        both = used_train & used_test
        assert not both, f"{len(both)} samples are both training and test samples, e.g. {sorted(both)[:5]}"
        if covers:
            assert used_train | used_test == set(range(n_train)), "the pooled partition leaves samples unused"
    elif covers:
        assert used_train == set(range(n_train)), f"{n_train - len(used_train)} training samples unused"
        assert used_test == set(range(n_test)), f"{n_test - len(used_test)} test samples unused"


def check_test_classes_within_train(y_tr, y_te, train, test, num_classes: int) -> None:
    for c, (a, b) in enumerate(zip(train, test)):
        outside = set(np.flatnonzero(histogram(y_te, b, num_classes))) - set(
            np.flatnonzero(histogram(y_tr, a, num_classes))
        )
        assert not outside, f"client {c} is tested on classes {sorted(outside)} it never trains on"


# ---- partitioners --------------------------------------------------------------------------------------------
def test_shards_promises():
    y_tr, y_te = labels([60] * 10), labels([20] * 10, seed=1)
    tr, te = Shards(2)(y_tr, y_te, 20, np.random.default_rng(0))
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    for c, (a, b) in enumerate(zip(tr, te)):  # the same two classes, in the same proportion (one shard each)
        h_tr, h_te = histogram(y_tr, a, 10), histogram(y_te, b, 10)
        assert set(np.flatnonzero(h_tr)) == set(np.flatnonzero(h_te)) and (h_tr > 0).sum() == 2, c
        np.testing.assert_array_equal(h_te * 3, h_tr)  # 60/20 = 3 train images per test image of a class


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_promises_and_test_mix_follows_train_mix(alpha):
    """The test split of every class is cut with the same proportions p ~ Dir(α) as its training split, so a
    client's share of class k differs between train and test only by the rounding of the cut points."""
    n_tr, n_te = [200] * 10, [50] * 10
    y_tr, y_te = labels(n_tr), labels(n_te, seed=1)
    tr, te = Dirichlet(alpha, min_samples=2)(y_tr, y_te, 12, np.random.default_rng(3))
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    h_tr = np.stack([histogram(y_tr, s, 10) for s in tr])  # clients × classes
    h_te = np.stack([histogram(y_te, s, 10) for s in te])
    share_tr, share_te = h_tr / np.array(n_tr), h_te / np.array(n_te)  # each column: a class over the clients
    rounding = 1 / np.array(n_tr) + 1 / np.array(n_te)
    assert (np.abs(share_tr - share_te) <= rounding + 1e-12).all(), np.abs(share_tr - share_te).max()
    # and the shares are not trivially equal: at small α a client's classes differ a lot from another's
    if alpha == 0.1:
        assert share_tr.max(0).min() > 0.3


def test_iid_split_promises():
    y_tr, y_te = labels([30] * 4), labels([7] * 4, seed=1)
    tr, te = IIDSplit()(y_tr, y_te, 5, np.random.default_rng(0))
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    assert [len(s) for s in tr] == [24] * 5 and sorted(len(s) for s in te) == [5, 5, 6, 6, 6]


@pytest.mark.parametrize("inner", ["shards", "dirichlet"])
def test_per_client_split_promises(inner):
    y = labels([40] * 5)
    part = Shards(2) if inner == "shards" else Dirichlet(0.5, min_samples=4)
    tr, te = PerClientSplit(part, test_fraction=0.25, stratify=True)(y, y[:0], 5, np.random.default_rng(0))
    check_partition(tr, te, len(y), len(y), pooled=True, covers=True)
    check_test_classes_within_train(y, y, tr, te, 5)
    for a, b in zip(tr, te):  # stratified: each class of the client keeps round(¼·m_k) test samples (≥ 1 if m_k ≥ 2)
        m = histogram(y, a, 5) + histogram(y, b, 5)
        want = np.where(m >= 2, np.clip(np.round(0.25 * m), 1, m - 1), 0)
        np.testing.assert_array_equal(histogram(y, b, 5), want)


def test_lognormal_promises():
    y = labels([400] * 10)
    tr, te = LogNormal(classes_per_client=3, mean_samples=30, min_samples=10, test_fraction=0.2)(
        y, y, 20, np.random.default_rng(0)
    )
    check_partition(tr, te, len(y), len(y), pooled=True, covers=False)  # quantity skew draws a subset
    check_test_classes_within_train(y, y, tr, te, 10)


def natural_pools():
    """Owner g has 6 + 2g training samples and 4 test samples, of classes {g mod 3, (g+1) mod 3}."""
    g_tr = torch.cat([torch.full((6 + 2 * g,), g) for g in range(6)])
    g_te = torch.arange(6).repeat_interleave(4)
    y_tr = (g_tr + torch.arange(len(g_tr)) % 2) % 3
    y_te = (g_te + torch.arange(len(g_te)) % 2) % 3
    return y_tr, y_te, g_tr, g_te


def test_natural_keeps_owners_whole_and_covers_the_data():
    y_tr, y_te, g_tr, g_te = natural_pools()
    tr, te = Natural()(y_tr, y_te, 6, np.random.default_rng(0), g_tr, g_te)
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    for a, b in zip(tr, te):
        assert len(set(g_tr[a].tolist())) == 1 and set(g_te[b].tolist()) == set(g_tr[a].tolist())


def test_natural_clients_per_group_split_every_class_over_the_owners_clients():
    y_tr, y_te, g_tr, g_te = natural_pools()
    tr, te = Natural(clients_per_group=2)(y_tr, y_te, 12, np.random.default_rng(0), g_tr, g_te)
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    check_test_classes_within_train(y_tr, y_te, tr, te, 3)


def test_natural_pooled_resplit_is_disjoint_and_covers():
    y_tr, y_te, g_tr, g_te = natural_pools()
    x = torch.zeros(len(y_tr) + len(y_te), 1)
    *_, train, _, _, test = partition_pools(
        Natural(test_fraction=0.25, stratify=True), x[: len(y_tr)], y_tr, x[len(y_tr) :], y_te, 6,
        np.random.default_rng(0), g_tr, g_te,
    )  # fmt: skip
    n = len(y_tr) + len(y_te)
    check_partition(train, test, n, n, pooled=True, covers=True)
    y, g = torch.cat([y_tr, y_te]), torch.cat([g_tr, g_te])
    check_test_classes_within_train(y, y, train, test, 3)
    for a, b in zip(train, test):
        assert len(set(g[torch.cat([a, b])].tolist())) == 1  # a client is one owner


def test_feature_shift_partition_and_groups():
    y_tr, y_te = labels([12] * 3), labels([4] * 3, seed=1)
    shift = FeatureShift(assignment="balanced")
    tr, te = shift(y_tr, y_te, 8, np.random.default_rng(0))
    check_partition(tr, te, len(y_tr), len(y_te), pooled=False, covers=True)
    groups = shift.assign_groups(8, np.random.default_rng(1))
    assert sorted(groups.tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_feature_shift_gives_a_clients_test_images_its_training_shift():
    """A client's test images are shifted like its training images (its test distribution is its own)."""
    from fl_lightning.engine.client_data import ClientSplit, FederatedData

    g = torch.Generator().manual_seed(0)
    x_tr, x_te = torch.rand(8, 1, 6, 6, generator=g), torch.rand(4, 1, 6, 6, generator=g)
    ptr_tr, ptr_te = torch.tensor([0, 2, 4, 6, 8]), torch.tensor([0, 1, 2, 3, 4])
    fed = FederatedData(ClientSplit(x_tr, torch.zeros(8), ptr_tr), ClientSplit(x_te, torch.zeros(4), ptr_te), 2)
    shift = FeatureShift(shifts=[(90.0, 0.0), (180.0, 0.0), (270.0, 0.0), (0.0, 0.0)])
    groups = torch.tensor([2, 0, 3, 1])
    out = shift.apply(fed, groups)
    for c, k in enumerate(groups.tolist()):
        turns = -(k + 1) % 4 if k < 3 else 0  # clockwise quarter turns
        for split, ptr, x in ((out.train, ptr_tr, x_tr), (out.test, ptr_te, x_te)):
            lo, hi = int(ptr[c]), int(ptr[c + 1])
            assert torch.equal(split.x[lo:hi], torch.rot90(x[lo:hi], turns, dims=(-2, -1))), (c, k)


# ---- dataset splitters ---------------------------------------------------------------------------------------
def row_keys(x: torch.Tensor, y: torch.Tensor) -> list[tuple[bytes, int]]:
    """One hashable key per sample: its pixels and its label."""
    flat = x.reshape(len(x), -1).numpy()
    return [(row.tobytes(), int(label)) for row, label in zip(flat, y.tolist())]


def test_digits_split_keeps_test_images_out_of_the_training_pool():
    """Train pool + test pool of the built federation is exactly the dataset (as a multiset: digits has a
    few duplicate images), so no held-out image is also a training image; each class holds out round(20 %)."""
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), test_fraction=0.2, seed=0)
    dm.setup("fit")
    fed = dm.federated
    x, y = load_digits_tensors()
    everything = Counter(row_keys(x, y))
    train, test = Counter(row_keys(fed.train.x, fed.train.y)), Counter(row_keys(fed.test.x, fed.test.y))
    doubled = (train + test) - everything
    assert not doubled, f"{sum(doubled.values())} images are in both the training and the test pool"
    assert train + test == everything  # Shards uses every sample of both pools
    per_class = np.bincount(y.numpy(), minlength=10)
    np.testing.assert_array_equal(np.bincount(fed.test.y.numpy(), minlength=10), np.round(0.2 * per_class))


def test_vision_holdout_clients_are_disjoint_from_the_federation(tmp_path):
    write_cifar10(tmp_path, train_per_class=12, test_per_class=4)
    dm = CIFAR10DataModule(num_clients=10, partition=Shards(2), data_dir=str(tmp_path), seed=0, holdout_clients=5)
    dm.setup("fit")
    fed, new = dm.federated, dm.new_clients
    keys = {name: Counter(row_keys(s.x, s.y)) for name, s in
            (("train", fed.train), ("test", fed.test), ("new_train", new.train), ("new_test", new.test))}  # fmt: skip
    assert all(n == 1 for counter in keys.values() for n in counter.values())  # fixture images are unique
    for a in keys:
        for b in keys:
            if a < b:
                assert not set(keys[a]) & set(keys[b]), f"{a} and {b} share samples"
    assert sum(keys["train"].values()) + sum(keys["new_train"].values()) == 120  # every training image used
    assert sum(keys["test"].values()) + sum(keys["new_test"].values()) == 40


def test_vision_transfer_classes_stay_out_of_the_federation(tmp_path):
    write_cifar10(tmp_path, train_per_class=12, test_per_class=4)
    dm = CIFAR10DataModule(
        num_clients=8, partition=Shards(2), data_dir=str(tmp_path), seed=0, classes=[0, 1, 2, 3, 4, 5, 6, 7],
        transfer_classes=[8, 9], transfer_clients=2,
    )  # fmt: skip
    dm.setup("fit")
    fed, new = dm.federated, dm.new_clients
    fed_keys, new_keys = set(row_keys(fed.train.x, fed.train.y)), set(row_keys(new.train.x, new.train.y))
    assert not {k[0] for k in fed_keys} & {k[0] for k in new_keys}
    assert len(fed_keys) == 8 * 12 and len(new_keys) == 2 * 12  # every training image of each side used
    assert set(fed.train.y.tolist()) == set(range(8)) and set(new.train.y.tolist()) == {0, 1}  # relabelled


def test_leaf_natural_clients_test_on_their_own_held_out_samples(tmp_path):
    write_femnist(tmp_path, users=5, per_user=(20, 30), classes=list(range(10)))
    dm = FEMNISTDataModule(num_clients=5, data_dir=str(tmp_path), seed=0)
    dm.setup("fit")
    fed = dm.federated
    train_keys = Counter(row_keys(fed.train.x, fed.train.y))
    test_keys = Counter(row_keys(fed.test.x, fed.test.y))
    assert not set(train_keys) & set(test_keys)
    owners = fed.extras["group"]
    assert sorted(owners.tolist()) == list(range(5))  # one client per LEAF user
    pools = dm.load()
    for c in range(5):
        own = pools.g_test == owners[c]
        assert Counter(row_keys(*fed.test.client(c))) == Counter(row_keys(pools.x_test[own], pools.y_test[own]))
        own = pools.g_train == owners[c]
        assert Counter(row_keys(*fed.train.client(c))) == Counter(row_keys(pools.x_train[own], pools.y_train[own]))


class OneClient(Shards):
    """Every sample to one client (the inner partition of these tests)."""

    def __call__(self, train_labels, test_labels, num_clients, rng):
        return [torch.arange(len(train_labels))], [torch.arange(len(test_labels))]


LABELS = torch.tensor([0] * 5 + [1] * 5)  # one client: 5 samples of each class


def split(**kwargs):
    train, test = PerClientSplit(OneClient(), **kwargs)(LABELS, LABELS[:0], 1, np.random.default_rng(0))
    return train[0].numpy(), test[0].numpy()


def test_default_is_a_twenty_percent_unstratified_cut():
    train, test = split()
    assert len(test) == 2 and len(train) == 8  # round(0.2 · 10)
    assert sorted(np.concatenate([train, test])) == list(range(10))


def test_stratify_cuts_every_class_and_plain_cut_does_not():
    # round(0.1 · 10) = 1 test sample in all; per class round(0.1 · 5) = 0, raised to 1 so each side keeps a sample
    train, test = split(test_fraction=0.1, stratify=False)
    assert len(test) == 1
    train, test = split(test_fraction=0.1)  # not stratified unless asked
    assert len(test) == 1
    train, test = split(test_fraction=0.1, stratify=True)
    assert len(test) == 2 and sorted(LABELS[test].tolist()) == [0, 1]


def test_test_fraction_zero_is_allowed_and_one_is_not():
    train, test = split(test_fraction=0.0)
    assert len(test) == 0 and len(train) == 10
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"PerClientSplit.test_fraction must be in \[0, 1\)"):
            PerClientSplit(OneClient(), test_fraction=bad)


def test_takes_uses_groups_from_its_inner_partition():
    assert PerClientSplit(Dirichlet()).uses_groups is False
    natural = type("Grouped", (OneClient,), {"uses_groups": True})()
    assert PerClientSplit(natural).uses_groups is True


def test_natural_inside_sees_only_the_training_pool_when_counting_owner_sizes():
    from datamodules.partition import Natural

    # owner 0 has 2 samples, owners 1 and 2 have 3: with min_samples = 3 only owners 1 and 2 are clients (id order)
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    labels = torch.zeros(8, dtype=torch.long)
    split_natural = PerClientSplit(Natural(min_samples=3), test_fraction=0.0)
    train, test = split_natural(labels, labels[:0], 2, np.random.default_rng(0), train_groups=groups)
    assert [t.tolist() for t in train] == [[2, 3, 4], [5, 6, 7]]
    assert all(len(t) == 0 for t in test)


def test_natural_inside_counts_owners_on_the_training_pool_only() -> None:
    """Owner 0 holds samples 0, 1 (fewer than ``min_samples`` = 3), owner 1 holds 2..5 (two of each class).
    Only owner 1 is eligible, so the two clients are owner 1 cut in two, class by class: no client holds a
    sample of owner 0, and every sample of owner 1 lands in exactly one client's train ∪ test."""
    groups = torch.tensor([0, 0, 1, 1, 1, 1])
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    train, test = PerClientSplit(Natural(min_samples=3), test_fraction=0.5)(
        labels, labels[:0], 2, np.random.default_rng(0), train_groups=groups
    )
    owned = [sorted(torch.cat([tr, te]).tolist()) for tr, te in zip(train, test)]
    assert sorted(i for client in owned for i in client) == [2, 3, 4, 5]
    assert [sorted(labels[c].tolist()) for c in owned] == [[0, 1], [0, 1]]  # class by class
    assert [len(t) for t in test] == [1, 1]  # round(0.5·2)


def test_a_callable_without_uses_groups_is_group_free() -> None:
    """A plain function as the inner partition: ``uses_groups`` is ``False`` (a bool) and the function is
    called without group arguments; its train sets are then cut as usual."""
    calls: list[dict] = []

    def halves(train_labels, test_labels, num_clients, rng, **kw):
        calls.append(kw)
        n = len(train_labels)
        return [torch.arange(0, n // 2), torch.arange(n // 2, n)], [torch.arange(0), torch.arange(0)]

    split = PerClientSplit(halves, test_fraction=0.5)
    assert split.uses_groups is False
    labels = torch.zeros(8, dtype=torch.long)
    train, test = split(labels, labels[:0], 2, np.random.default_rng(0), train_groups=torch.zeros(8, dtype=torch.long))
    assert calls == [{}]
    assert [sorted(torch.cat([a, b]).tolist()) for a, b in zip(train, test)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(t) for t in test] == [2, 2]


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


def class_counts(y: torch.Tensor, sets, num_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[s].numpy(), minlength=num_classes) for s in sets])


# ---- partitioners ---------------------------------------------------------------------------------------
def test_shards_exact_classes_and_counts():
    y_tr, y_te = labels([100] * 10), labels([20] * 10, seed=1)
    tr, te = Shards(5)(y_tr, y_te, 20, np.random.default_rng(0))
    h_tr, h_te = class_counts(y_tr, tr, 10), class_counts(y_te, te, 10)
    # 20·5 = 100 shards, 10 per class of 100/10 = 10 images; test shards of 20/10 = 2 images
    assert ((h_tr > 0).sum(1) == 5).all() and set(h_tr[h_tr > 0].tolist()) == {10}
    assert ((h_te > 0) == (h_tr > 0)).all() and set(h_te[h_te > 0].tolist()) == {2}
    assert sorted(torch.cat(tr).tolist()) == list(range(1000))  # every sample used once


def test_dirichlet_tracks_alpha():
    y = labels([300] * 10)

    def mean_top_share(alpha: float) -> float:
        tr, _ = Dirichlet(alpha, min_samples=1)(y, y[:0], 10, np.random.default_rng(0))
        h = class_counts(y, tr, 10)
        return float((h.max(1) / h.sum(1)).mean())

    # near-uniform class mix at large α (10 classes → top share ≈ 0.1), one dominant class at small α
    assert mean_top_share(1000.0) < 0.15
    assert mean_top_share(0.05) > 0.5


def test_lognormal_hits_mean_and_minimum_with_consecutive_classes():
    y = labels([4000] * 10)
    part = LogNormal(classes_per_client=3, mean_samples=148, min_samples=50, test_fraction=0.1)
    tr, te = part(y, y, 150, np.random.default_rng(0))
    sizes = np.array([len(a) + len(b) for a, b in zip(tr, te)])
    assert sizes.sum() == 150 * 148 and sizes.min() == 50
    assert np.median(sizes) < sizes.mean()  # right-skewed like lognormal(4, 1)
    h = class_counts(y, [torch.cat([a, b]) for a, b in zip(tr, te)], 10)
    for i in range(150):
        assert set(np.flatnonzero(h[i])) == {(i + j) % 10 for j in range(3)}
        assert h[i].max() - h[i][h[i] > 0].min() <= 1  # split evenly over the 3 classes
    test_share = sum(len(b) for b in te) / sizes.sum()
    assert abs(test_share - 0.1) < 0.01
    all_idx = torch.cat([*tr, *te])
    assert len(set(all_idx.tolist())) == len(all_idx)  # drawn without replacement


def test_natural_min_samples_sampling_and_groups():
    # owner g has 10 + 5g training samples and 2 test samples
    g_tr = torch.cat([torch.full((10 + 5 * g,), g) for g in range(10)])
    g_te = torch.arange(10).repeat_interleave(2)
    y_tr, y_te = torch.zeros_like(g_tr), torch.zeros_like(g_te)
    tr, te = Natural(min_samples=30)(y_tr, y_te, 4, np.random.default_rng(0), g_tr, g_te)
    owners = [int(g_tr[s[0]]) for s in tr]
    assert len(set(owners)) == 4 and all(10 + 5 * g + 2 >= 30 for g in owners)
    for s, t, g in zip(tr, te, owners):  # each client is one owner, whole
        assert sorted(s.tolist()) == torch.nonzero(g_tr == g).flatten().tolist()
        assert sorted(t.tolist()) == torch.nonzero(g_te == g).flatten().tolist()
    # two clients per owner, split class by class
    y2 = torch.arange(len(g_tr)) % 2
    tr2, _ = Natural(clients_per_group=2)(y2, y_te, 20, np.random.default_rng(0), g_tr, g_te)
    for a, b in zip(tr2[0::2], tr2[1::2]):
        assert int(g_tr[a[0]]) == int(g_tr[b[0]])
        assert abs(len(a) - len(b)) <= 2 and set(y2[a].tolist()) == set(y2[b].tolist()) == {0, 1}


def test_per_client_split_ratio():
    y = labels([50] * 4)
    tr, te = PerClientSplit(Shards(2), test_fraction=0.2, stratify=True)(y, y[:0], 4, np.random.default_rng(0))
    for a, b in zip(tr, te):
        assert len(b) == round(0.2 * (len(a) + len(b)))
        assert not set(a.tolist()) & set(b.tolist())
        assert set(y[a].tolist()) == set(y[b].tolist())
