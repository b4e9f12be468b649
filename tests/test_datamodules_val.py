"""The validation split carved from every client's training rows (``val_fraction``; issue 15, no tuning on test)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from data_fixtures import write_femnist  # noqa: E402

from datamodules import DigitsDataModule, DigitsShiftDataModule, FEMNISTDataModule, Natural, Shards  # noqa: E402
from datamodules.base import split_validation  # noqa: E402
from datamodules.mixed_regression import MixedRegressionDataModule  # noqa: E402
from datamodules.partition_report import partition_report  # noqa: E402
from datamodules.synthetic import SyntheticLinearDataModule  # noqa: E402
from fl_lightning.engine.client_data import ClientSplit  # noqa: E402
from fl_lightning.errors import ConfigError  # noqa: E402


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
