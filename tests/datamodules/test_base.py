"""``datamodules/base.py``: ``FederatedDataModule``'s constructor checks, the validation split carved from every
client's training rows, the test loader's chunks over ranks, and the partition hash."""

from __future__ import annotations

import hashlib
from collections import Counter
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from datamodules import DigitsDataModule, DigitsShiftDataModule, FEMNISTDataModule, Natural, Shards
from datamodules.base import FederatedDataModule, split_validation
from datamodules.mixed_regression import MixedRegressionDataModule
from datamodules.partition_report import partition_report
from datamodules.synthetic import SyntheticLinearDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from tests.helpers.cifar_data import cifar_dm
from tests.helpers.data_fixtures import write_cifar10, write_femnist
from tests.helpers.stand_ins import with_trainer


def test_defaults_are_twenty_clients_and_a_tenth_of_them_per_round() -> None:
    dm = FederatedDataModule()
    assert dm.num_clients == 20
    assert dm.clients_per_round == 2  # round(0.1 · 20)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1])
def test_val_fraction_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="val_fraction"):
        FederatedDataModule(num_clients=4, val_fraction=bad)


@pytest.mark.parametrize("bad", [0.0, 1.5, 2.0])
def test_participation_outside_open_closed_unit_interval_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="participation"):
        FederatedDataModule(num_clients=4, participation=bad)


def test_participation_one_and_clients_per_round_edges_are_accepted() -> None:
    assert FederatedDataModule(num_clients=4, participation=1.0).clients_per_round == 4
    assert FederatedDataModule(num_clients=4, clients_per_round=1).clients_per_round == 1
    assert FederatedDataModule(num_clients=4, clients_per_round=4).clients_per_round == 4
    with pytest.raises(ConfigError, match="clients_per_round"):
        FederatedDataModule(num_clients=4, clients_per_round=0)
    with pytest.raises(ConfigError, match="clients_per_round"):
        FederatedDataModule(num_clients=4, clients_per_round=5)


@pytest.mark.parametrize(
    ("num_clients", "participation", "expected"),
    [(10, 0.5, 5), (30, None, 3), (5, 0.1, 1), (40, 0.25, 10), (7, None, 1)],
)
def test_cohort_size_is_participation_times_clients_at_least_one(
    num_clients: int, participation: float | None, expected: int
) -> None:
    r = 0.1 if participation is None else participation
    assert expected == max(1, round(r * num_clients))  # the reference rule, stated here
    assert FederatedDataModule(num_clients=num_clients, participation=participation).clients_per_round == expected


def test_make_federated_records_the_modules_seed() -> None:
    dm = FederatedDataModule(num_clients=2, seed=1234)
    x, y = torch.arange(8.0).view(4, 2), torch.tensor([0, 1, 0, 1])
    sets = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    fed = dm.make_federated(x, y, sets, x, y, sets, 2)
    assert fed.seed == 1234


class _TwoClassClients(FederatedDataModule):
    """Every client holds 5 rows of class 0 and 5 of class 1."""

    def build(self) -> FederatedData:
        n = self.num_clients * 10
        y = torch.tensor([0, 1] * (n // 2))
        x = torch.arange(n, dtype=torch.float32).view(n, 1)
        sets = [torch.arange(10 * c, 10 * c + 10) for c in range(self.num_clients)]
        return self.make_federated(x, y, sets, x, y, sets, 2)


def test_setup_carves_a_stratified_validation_split() -> None:
    """fraction 0.2 of 10 rows = 2 val rows, one per class (proportional shares 1 and 1) on every client."""
    dm = _TwoClassClients(num_clients=20, seed=3, val_fraction=0.2)
    dm.setup("fit")
    val = dm.federated.val
    assert val is not None and val.num_clients == 20
    for c in range(20):
        _, yv = val.client(c)
        assert Counter(yv.tolist()) == {0: 1, 1: 1}, c


def clients_of(loader) -> list[int]:
    return [c for chunk in loader for c in chunk]


def test_test_clients_are_split_over_ranks() -> None:
    num_clients, world = 7, 3
    seen: list[int] = []
    for rank in range(world):
        dm = DigitsDataModule(num_clients=num_clients)
        with_trainer(dm, global_rank=rank, world_size=world, max_steps=1)
        test, val = clients_of(dm.test_dataloader()), clients_of(dm.val_dataloader())
        assert test == [c for c in range(num_clients) if c % world == rank] == val
        seen += test
    assert sorted(seen) == list(range(num_clients))


def rows(x: torch.Tensor) -> Counter:
    return Counter(r.numpy().tobytes() for r in x.reshape(len(x), -1))


def digits(val_fraction: float = 0.0, seed: int = 0, **kw) -> DigitsDataModule:
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), seed=seed, val_fraction=val_fraction, **kw)
    dm.setup("fit")
    return dm


def check_quota(train_y: torch.Tensor, val_y: torch.Tensor, fraction: float) -> None:
    """Independent statement of the rule: val has round(f·n) rows (1 ≤ · ≤ n−1) and every class gets the
    floor or the ceiling of its proportional share."""
    n = len(train_y) + len(val_y)
    quota = min(n - 1, max(1, round(fraction * n)))
    assert len(val_y) == quota
    full = Counter(train_y.tolist()) + Counter(val_y.tolist())
    got = Counter(val_y.tolist())
    for cls, count in full.items():
        share = quota * count / n
        assert int(np.floor(share)) <= got.get(cls, 0) <= int(np.ceil(share)), (cls, count, share, got)
    assert set(got) <= set(full)


def test_val_rows_are_the_clients_own_training_rows_disjoint_and_stratified():
    plain, carved = digits(0.0), digits(0.25)
    p, c = plain.federated, carved.federated
    assert p.val is None and c.val is not None and c.val.num_clients == 10
    assert torch.equal(c.test.x, p.test.x) and torch.equal(c.test.ptr, p.test.ptr)  # test untouched
    for k in range(10):
        (x0, y0), (xt, yt), (xv, yv) = p.train.client(k), c.train.client(k), c.val.client(k)
        # together exactly the client's former training rows, none used twice (multisets of whole rows)
        assert rows(torch.cat([xt, xv])) == rows(x0)
        assert Counter(torch.cat([yt, yv]).tolist()) == Counter(y0.tolist())
        check_quota(yt, yv, 0.25)
    assert partition_report(carved)["val_sizes"] == c.val.sizes.tolist()


def test_split_validation_on_indexed_rows():
    """Rows carry their own index: exact disjointness, order kept, class mix, and the seed's role."""
    y = torch.tensor([0] * 7 + [1] * 3 + [2] * 1 + [0] * 4 + [3] * 6 + [1] * 5)
    ptr = torch.tensor([0, 11, 15, 26])
    split = ClientSplit(torch.arange(len(y)).unsqueeze(1), y, ptr)
    train, val = split_validation(split, 0.3, 4, np.random.default_rng(0))
    for c in range(3):
        lo, hi = int(ptr[c]), int(ptr[c + 1])
        tr, va = train.client(c)[0].flatten().tolist(), val.client(c)[0].flatten().tolist()
        assert not set(tr) & set(va) and sorted(tr + va) == list(range(lo, hi))
        assert tr == sorted(tr) and va == sorted(va)
        assert torch.equal(train.client(c)[1], y[tr]) and torch.equal(val.client(c)[1], y[va])
        check_quota(y[tr], y[va], 0.3)
    again = split_validation(split, 0.3, 4, np.random.default_rng(0))[1]
    assert torch.equal(again.x, val.x) and torch.equal(again.ptr, val.ptr)
    draws = [split_validation(split, 0.3, 4, np.random.default_rng(s))[1] for s in range(8)]
    others = {tuple(v.x.flatten().tolist()) for v in draws}
    assert len(others) > 1  # the draw depends on the seed
    # regression targets: no classes, plain uniform draw of the same sizes
    reg = ClientSplit(torch.arange(26.0).unsqueeze(1), torch.randn(26), ptr)
    rtrain, rval = split_validation(reg, 0.3, None, np.random.default_rng(1))
    assert rval.sizes.tolist() == [3, 1, 3] and rtrain.sizes.tolist() == [8, 3, 8]
    assert not set(rtrain.x.flatten().tolist()) & set(rval.x.flatten().tolist())


def test_val_fraction_zero_is_todays_data_and_the_split_is_reproducible():
    default = DigitsDataModule(num_clients=10, partition=Shards(2), seed=0)
    default.setup("fit")
    zero = digits(0.0)
    built = DigitsDataModule(num_clients=10, partition=Shards(2), seed=0).build()  # no setup: no carving at all
    for split in ("train", "test"):
        a, b = getattr(zero.federated, split), getattr(built, split)
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.ptr, b.ptr)
    assert zero.partition_hash() == default.partition_hash()
    first, second, other_seed = digits(0.2), digits(0.2), digits(0.2, seed=1)
    assert torch.equal(first.federated.val.x, second.federated.val.x)
    assert first.partition_hash() == second.partition_hash() != zero.partition_hash()
    assert other_seed.partition_hash() != first.partition_hash()
    # the split is drawn from its own stream: the partition (train ∪ val per client) is the seed's partition
    for k in range(10):
        whole = torch.cat([first.federated.train.client(k)[0], first.federated.val.client(k)[0]])
        assert rows(whole) == rows(zero.federated.train.client(k)[0])


def test_evaluation_split_and_errors():
    carved = digits(0.2).federated
    assert carved.evaluation_split("test") is carved.test and carved.evaluation_split("val") is carved.val
    with pytest.raises(ConfigError, match="val_fraction"):
        digits(0.0).federated.evaluation_split("val")
    with pytest.raises(ConfigError, match="'train'"):
        carved.evaluation_split("train")
    with pytest.raises(ConfigError, match="val_fraction must be in"):
        DigitsDataModule(val_fraction=1.0)
    tiny = ClientSplit(torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), torch.tensor([0, 2, 3]))
    with pytest.raises(ConfigError, match=r"clients \[1\] have fewer than 2"):
        split_validation(tiny, 0.5, 1, np.random.default_rng(0))
    moved = carved.to("cpu")
    assert torch.equal(moved.val.x, carved.val.x)


def test_val_through_natural_clients_and_feature_shift(tmp_path):
    write_femnist(tmp_path, users=4, per_user=(20, 30))
    fem = FEMNISTDataModule(num_clients=4, partition=Natural(), data_dir=str(tmp_path), seed=0, val_fraction=0.2)
    fem.setup("fit")
    ref = FEMNISTDataModule(num_clients=4, partition=Natural(), data_dir=str(tmp_path), seed=0)
    ref.setup("fit")
    for k in range(4):  # each LEAF user's validation rows come from that user's training file
        whole = torch.cat([fem.federated.train.client(k)[0], fem.federated.val.client(k)[0]])
        assert rows(whole) == rows(ref.federated.train.client(k)[0])
    # PerFedSI's shifted digits: val rows are resized and shifted with their client's group, like train
    shifted = DigitsShiftDataModule(num_clients=8, image_size=16, seed=0, val_fraction=0.25)
    shifted.setup("fit")
    fed, base = shifted.federated, shifted.base.federated
    assert fed.val.x.shape[1:] == fed.train.x.shape[1:] == (1, 16, 16)
    resized = shifted.prepare(base)
    for k in range(8):
        group = int(fed.extras["shift_group"][k])
        expect = shifted.shift.transform(resized.val.client(k)[0], group)
        assert torch.allclose(fed.val.client(k)[0], expect, atol=1e-6)


def test_a_run_with_a_validation_split_trains(tmp_path):
    from fl_lightning.cli import train_config

    summary = train_config(
        ["configs/quickstart.yaml"],
        ["--data.init_args.val_fraction", "0.2", "--data.init_args.num_clients", "5", "--trainer.max_steps", "1",
         "--trainer.logger", "false", "--trainer.enable_checkpointing", "false", "--model.eval_last", "1"],
        run_dir=tmp_path,
    )  # fmt: skip
    assert summary["rounds"] == 1 and 0 <= summary["final"] <= 1


@pytest.mark.parametrize(
    "make",
    [
        lambda f: SyntheticLinearDataModule(num_clients=6, samples_per_client=10, val_fraction=f, seed=3),
        lambda f: MixedRegressionDataModule(setting=None, sizes="6x20", num_clusters=2, dim=5, val_fraction=f, seed=3),
    ],
    ids=["synthetic_linear", "mixed_regression"],
)
def test_regression_generators_take_a_validation_split(make):
    """The papers' regression generators accept ``val_fraction``: each client's validation rows plus its training
    rows are exactly its rows without the split (same x, same y), and the test split is untouched."""
    whole, split = make(0.0), make(0.25)
    whole.setup("fit"), split.setup("fit")
    a, b = whole.federated, split.federated
    assert a.val is None and b.val is not None
    assert torch.equal(b.val.sizes, torch.full((6,), round(0.25 * int(a.train.sizes[0]))))
    for c in range(6):
        xa, ya = a.train.client(c)
        xt, yt = b.train.client(c)
        xv, yv = b.val.client(c)
        rows = {tuple(r.tolist()) + (float(t),) for r, t in zip(xa, ya)}
        got = [tuple(r.tolist()) + (float(t),) for r, t in zip(torch.cat([xt, xv]), torch.cat([yt, yv]))]
        assert len(got) == len(rows) and set(got) == rows
        assert not {tuple(r.tolist()) for r in xt} & {tuple(r.tolist()) for r in xv}
        assert torch.equal(a.test.client(c)[0], b.test.client(c)[0])


class OrderedRng:
    """A stand-in for ``np.random.Generator`` whose "random" orders are the identity: ``permutation`` keeps
    its input's order and ``choice`` takes the first positions. With it every draw of ``split_validation``
    is fixed, so the tie-break order is the class order and each class gives its first rows."""

    def permutation(self, x: int | np.ndarray) -> np.ndarray:
        return np.arange(x) if isinstance(x, (int, np.integer)) else np.array(x, copy=True)

    def choice(self, n: int, size: int, replace: bool = True) -> np.ndarray:
        return np.arange(size)


def indexed(labels: list[int], sizes: list[int]) -> ClientSplit:
    """Clients of the given sizes; row ``i`` carries ``i`` as its feature, so rows can be read back."""
    ptr = torch.tensor([0, *np.cumsum(sizes).tolist()])
    return ClientSplit(torch.arange(len(labels)).unsqueeze(1), torch.tensor(labels), ptr)


def val_rows(val: ClientSplit, c: int) -> list[int]:
    return val.client(c)[0].flatten().tolist()


def test_quota_is_clamped_to_keep_one_row_on_each_side() -> None:
    """n = 2 and n = 3 at fraction 0.9: round(0.9·n) = n, clamped to n − 1; n = 2 at 0.2: round(0.4) = 0,
    raised to 1. With and without classes."""
    split = indexed([0, 1, 0, 1, 1, 0, 1], [2, 3, 2])
    for num_classes in (None, 2):
        train, val = split_validation(split, 0.9, num_classes, np.random.default_rng(0))
        assert val.sizes.tolist() == [1, 2, 1] and train.sizes.tolist() == [1, 1, 1], num_classes
        train, val = split_validation(split, 0.2, num_classes, np.random.default_rng(0))
        assert val.sizes.tolist() == [1, 1, 1] and train.sizes.tolist() == [1, 2, 1], num_classes


def test_extra_rows_go_to_the_largest_remainder_not_the_largest_class() -> None:
    """One client: 9 rows of class 0, 2 of class 1, fraction 0.45 → quota round(4.95) = 5. Shares 45/11 and
    10/11: floors 4 and 0 (sum 4), and the one extra row goes to class 1 (remainder 10/11 > 1/11)."""
    labels = [0] * 9 + [1] * 2
    train, val = split_validation(indexed(labels, [11]), 0.45, 2, np.random.default_rng(3))
    got = torch.bincount(val.y, minlength=2).tolist()
    assert got == [4, 1]
    assert sorted(val_rows(val, 0) + train.client(0)[0].flatten().tolist()) == list(range(11))


def test_remainder_ties_follow_the_rng_order_through_a_stable_sort() -> None:
    """20 classes, 32 rows, quota 6 (fraction 6/32): shares 6·c/32 are exact in binary, so equal counts tie.
    With the identity "permutation" the stable sort hands the extra rows to the lowest labels among the
    largest remainders; each class then gives its first rows. Reference: exact fractions, Python's sort."""
    counts = [2, 2, 1, 1, 1, 3, 1, 3, 3, 1, 3, 1, 1, 1, 1, 2, 1, 1, 2, 1]
    n, quota = sum(counts), 6
    labels = np.repeat(np.arange(len(counts)), counts)
    labels = labels[np.random.default_rng(7).permutation(n)]  # interleave the classes inside the client
    shares = [Fraction(quota * c, n) for c in counts]
    take = [int(s) for s in shares]  # floors (shares are positive)
    by_remainder = sorted(range(len(counts)), key=lambda k: (-(shares[k] - take[k]), k))
    for k in by_remainder[: quota - sum(take)]:
        take[k] += 1
    expected = sorted(i for k, t in enumerate(take) for i in np.flatnonzero(labels == k)[:t].tolist())
    train, val = split_validation(indexed(labels.tolist(), [n]), quota / n, len(counts), OrderedRng())
    assert val_rows(val, 0) == expected
    assert train.client(0)[0].flatten().tolist() == sorted(set(range(n)) - set(expected))


def test_without_classes_the_draw_ignores_the_labels() -> None:
    """``num_classes=None`` draws the quota uniformly over a client's rows: with 5 + 5 rows of two labels and
    quota 2, a class-blind draw picks two rows of one label with probability 4/9, so over 20 seeds some draw
    does; a stratified draw never would. With classes every draw is one row per label."""
    labels = [0] * 5 + [1] * 5
    split = indexed(labels, [10])
    blind = [sorted(split_validation(split, 0.2, None, np.random.default_rng(s))[1].y.tolist()) for s in range(20)]
    assert all(len(v) == 2 for v in blind)
    assert any(v != [0, 1] for v in blind)
    strat = [sorted(split_validation(split, 0.2, 2, np.random.default_rng(s))[1].y.tolist()) for s in range(20)]
    assert all(v == [0, 1] for v in strat)


def _reference(splits: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for x, y, ptr in splits:
        h.update(ptr.astype(np.int64).tobytes())
        h.update(y.astype(np.int64).tobytes())
        h.update(x.reshape(len(x), -1).astype(np.float32).sum(axis=1).round(4).tobytes())
    return h.hexdigest()[:16]


def _hash(fed: FederatedData) -> str:
    return FederatedDataModule.partition_hash(SimpleNamespace(federated=fed))  # type: ignore[arg-type]


def _split(x: np.ndarray, y: list[int], ptr: list[int]) -> ClientSplit:
    return ClientSplit(torch.tensor(x, dtype=torch.float32), torch.tensor(y), torch.tensor(ptr))


# Rows of shape [2, 2] with one non-zero entry each: their sums are exact in float32 in any order.
X_TRAIN = np.zeros((3, 2, 2), dtype=np.float32)
X_TRAIN[0, 0, 1], X_TRAIN[1, 1, 0], X_TRAIN[2, 1, 1] = 0.123456, 2.0, -1.5


X_TEST = np.zeros((2, 2, 2), dtype=np.float32)
X_TEST[0, 1, 0], X_TEST[1, 0, 0] = 3.0, 0.25


X_VAL = np.zeros((1, 2, 2), dtype=np.float32)
X_VAL[0, 0, 0] = 7.0


def test_hash_without_validation_split_matches_the_reference() -> None:
    fed = FederatedData(_split(X_TRAIN, [1, 0, 1], [0, 2, 3]), _split(X_TEST, [0, 1], [0, 1, 2]), 2)
    want = _reference([(X_TRAIN, np.array([1, 0, 1]), np.array([0, 2, 3])),
                       (X_TEST, np.array([0, 1]), np.array([0, 1, 2]))])  # fmt: skip
    got = _hash(fed)
    assert len(got) == 16 and got == want


def test_hash_includes_the_validation_split() -> None:
    train, test = _split(X_TRAIN, [1, 0, 1], [0, 2, 3]), _split(X_TEST, [0, 1], [0, 1, 2])
    val = _split(X_VAL, [1], [0, 0, 1])
    got = _hash(FederatedData(train, test, 2, val=val))
    want = _reference([(X_TRAIN, np.array([1, 0, 1]), np.array([0, 2, 3])),
                       (X_TEST, np.array([0, 1]), np.array([0, 1, 2])),
                       (X_VAL, np.array([1]), np.array([0, 0, 1]))])  # fmt: skip
    assert got == want
    assert got != _hash(FederatedData(train, test, 2))


def test_rows_with_the_same_sums_hash_alike_and_different_sums_do_not() -> None:
    """``[[1, 0], [0, 1]]`` and ``[[1, 1], [0, 0]]`` have the same column sums and total but different row sums;
    a pixel moved inside a row, or noise below the 4th decimal, leaves every row sum (rounded) unchanged."""
    y, ptr = [0, 1], [0, 1, 2]
    test = _split(np.zeros((0, 2), dtype=np.float32), [], [0, 0, 0])
    a = _hash(FederatedData(_split(np.array([[1.0, 0.0], [0.0, 1.0]]), y, ptr), test, 2))
    b = _hash(FederatedData(_split(np.array([[1.0, 1.0], [0.0, 0.0]]), y, ptr), test, 2))
    assert a != b
    c = _hash(FederatedData(_split(np.array([[[1.0, 0.0], [0.0, 0.0]]]), [0], [0, 1]), test, 2))
    d = _hash(FederatedData(_split(np.array([[[0.0, 0.0], [1.0, 0.0]]]), [0], [0, 1]), test, 2))
    assert c == d
    e = _hash(FederatedData(_split(np.array([[0.10001, 0.0], [0.0, 1.0]]), y, ptr), test, 2))
    f = _hash(FederatedData(_split(np.array([[0.10002, 0.0], [0.0, 1.0]]), y, ptr), test, 2))
    assert e == f


def test_same_seed_same_hash(tmp_path):
    write_cifar10(tmp_path, train_per_class=10, test_per_class=4)
    a, b, c = cifar_dm(tmp_path, 0), cifar_dm(tmp_path, 0), cifar_dm(tmp_path, 1)
    for dm in (a, b, c):
        dm.setup("fit")
    assert a.partition_hash() == b.partition_hash() != c.partition_hash()
