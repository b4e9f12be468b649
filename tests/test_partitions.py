"""Every partitioner and dataset splitter against the promises a partition makes (issue 20, item 3):

* train and test indices are disjoint (for partitioners that cut one merged pool themselves);
* no sample belongs to two clients;
* every sample is used, where the partition promises it;
* each client's test class mix follows its training mix;
* the dataset splitters keep the held-out test images out of the training pool.

The checks are written out here from the index sets and labels, not from the partition report.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from data_fixtures import write_cifar10, write_femnist  # noqa: E402

from datamodules import (  # noqa: E402
    CIFAR10DataModule,
    DigitsDataModule,
    Dirichlet,
    FeatureShift,
    FEMNISTDataModule,
    IIDSplit,
    LogNormal,
    Natural,
    PerClientSplit,
    Shards,
)
from datamodules.digits import load_digits_tensors  # noqa: E402
from datamodules.partition import partition_pools  # noqa: E402


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
