"""Dataset loaders on files written in their real on-disk formats, through the public DataModules."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    MNISTDataModule,
    OmniglotDataModule,
    Shards,
)
from tests.helpers.data_fixtures import (
    write_cifar10,
    write_cifar100,
    write_emnist,
    write_idx,
    write_mnist,
    write_omniglot,
)
from tests.helpers.loaders import built, one_line_error, row_keys


# ---- CIFAR ----------------------------------------------------------------------------------------------
def test_cifar10_reads_pickles_normalises_and_shards(tmp_path):
    write_cifar10(tmp_path, train_per_class=10, test_per_class=4)
    fed = built(CIFAR10DataModule(num_clients=10, partition=Shards(2), data_dir=str(tmp_path), seed=0))
    # independent reading of the pickles
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    raw = [pickle.loads((tmp_path / "cifar-10-batches-py" / f"data_batch_{i}").read_bytes()) for i in range(1, 6)]
    x = np.concatenate([r["data"] for r in raw]).reshape(-1, 3, 32, 32) / 255.0
    x = (x - mean.reshape(1, 3, 1, 1)) / std.reshape(1, 3, 1, 1)
    assert row_keys(fed.train.x) == row_keys(torch.tensor(x, dtype=torch.float32))
    assert fed.num_classes == 10 and fed.train.x.shape[1:] == (3, 32, 32)
    # 10 clients × 2 shards = 20 shards: 2 per class of 5 images; test shards 2 per class of 2 images
    assert fed.train.sizes.tolist() == [10] * 10 and fed.test.sizes.tolist() == [4] * 10
    for c in range(10):
        tr, te = set(fed.train.client(c)[1].tolist()), set(fed.test.client(c)[1].tolist())
        assert len(tr) == 2 and tr == te
    assert fed.augment is not None


def test_cifar100_fine_labels_and_class_disjoint_transfer(tmp_path):
    write_cifar100(tmp_path, train_per_class=4, test_per_class=2)
    dm = CIFAR100DataModule(
        num_clients=8, partition=Shards(10), data_dir=str(tmp_path), transfer_classes=list(range(80, 100)),
        transfer_clients=2, seed=0,
    )  # fmt: skip
    fed = built(dm)
    blob = pickle.loads((tmp_path / "cifar-100-python" / "train").read_bytes())
    fine = np.asarray(blob["fine_labels"])
    assert fed.train.y.max() < 80 and fed.train.x.shape[0] == int((fine < 80).sum())
    new = dm.new_clients
    assert new is not None and new.num_clients == 2
    # every new client has all 20 new classes (relabelled 0..19) in equal numbers: 4 images / 2 clients
    for c in range(2):
        counts = torch.bincount(new.train.client(c)[1], minlength=20)
        assert counts.tolist() == [2] * 20
    assert new.train.x.shape[0] == int((fine >= 80).sum())
    assert not set(row_keys(new.train.x)) & set(row_keys(fed.train.x))


# ---- MNIST / EMNIST -------------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx(tmp_path, gz):
    write_mnist(tmp_path, train_per_class=6, test_per_class=2, gz=gz)
    dm = MNISTDataModule(num_clients=5, partition=Shards(2), data_dir=str(tmp_path), holdout_clients=5, seed=0)
    fed = built(dm)
    raw = tmp_path / "MNIST" / "raw" / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    data = __import__("gzip").decompress(raw.read_bytes()) if gz else raw.read_bytes()
    assert data[:4] == bytes([0, 0, 8, 3])
    images = np.frombuffer(data[16:], np.uint8).reshape(-1, 1, 28, 28) / 255.0
    all_x = torch.cat([fed.train.x, dm.new_clients.train.x])
    assert row_keys(all_x) == row_keys(torch.tensor(images, dtype=torch.float32))
    # held-out clients: same partition (2 classes each), disjoint from the federation
    assert dm.new_clients.num_clients == 5 and fed.num_clients == 5
    assert all(len(set(dm.new_clients.train.client(c)[1].tolist())) == 2 for c in range(5))


def test_emnist_letters_labels_and_orientation(tmp_path):
    write_emnist(tmp_path, "letters", train_per_class=2, test_per_class=1)
    fed = built(EMNISTDataModule(num_clients=2, partition=Shards(26), split="letters", data_dir=str(tmp_path)))
    assert fed.num_classes == 26 and int(fed.train.y.min()) == 0 and int(fed.train.y.max()) == 25
    raw = tmp_path / "EMNIST" / "raw"
    imgs = np.frombuffer((raw / "emnist-letters-train-images-idx3-ubyte").read_bytes()[16:], np.uint8)
    labels = np.frombuffer((raw / "emnist-letters-train-labels-idx1-ubyte").read_bytes()[8:], np.uint8)
    upright = imgs.reshape(-1, 28, 28).transpose(0, 2, 1)[:, None] / 255.0
    assert row_keys(fed.train.x) == row_keys(torch.tensor(upright, dtype=torch.float32))
    assert sorted(fed.train.y.tolist()) == sorted((labels - 1).tolist())


# ---- Omniglot -------------------------------------------------------------------------------------------
def test_omniglot_alphabets_are_clients(tmp_path):
    write_omniglot(tmp_path, {"Alpha": 3, "Beta": 2}, {"Gamma": 2}, drawings=20)
    dm = OmniglotDataModule(num_clients=3, data_dir=str(tmp_path), seed=0)
    fed = built(dm)
    assert fed.num_classes == 7 and fed.train.x.shape[1:] == (1, 28, 28)
    alphabet_chars = {0: {0, 1, 2}, 1: {3, 4}, 2: {5, 6}}  # background sorted (Alpha, Beta), then evaluation
    assert dm.group_names == ["background/Alpha", "background/Beta", "evaluation/Gamma"]
    for c in range(3):
        y_tr, y_te = fed.train.client(c)[1], fed.test.client(c)[1]
        chars = alphabet_chars[int(fed.extras["alphabet"][c])]
        assert set(y_tr.tolist()) == chars == set(y_te.tolist())
        assert torch.bincount(y_tr)[sorted(chars)].tolist() == [16] * len(chars)  # 80/20 of 20 drawings
        assert torch.bincount(y_te)[sorted(chars)].tolist() == [4] * len(chars)
    # strokes (black squares in the PNGs) become 1 after inversion
    assert fed.train.x.max() == 1.0 and fed.train.x.min() == 0.0
    # 4 clients per alphabet → 5 drawings per character per client: 4 train + 1 test
    fed4 = built(OmniglotDataModule(num_clients=12, data_dir=str(tmp_path), seed=0))
    assert fed4.train.sizes.sum() == 7 * 4 * 4 and fed4.test.sizes.sum() == 7 * 4
    # M = 10 clients per alphabet → 2 drawings per character per client: 1 train + 1 test
    fed10 = built(OmniglotDataModule(num_clients=30, data_dir=str(tmp_path), seed=0))
    assert fed10.train.sizes.sum() == 7 * 10 and fed10.test.sizes.sum() == 7 * 10


def test_cifar_files_are_checked_against_the_published_md5(tmp_path, monkeypatch):
    """torchvision's real md5 check (restored here) refuses files that are not the published ones, naming one."""
    from torchvision.datasets import cifar, utils

    monkeypatch.setattr(cifar, "check_integrity", utils.check_integrity)
    write_cifar10(tmp_path)
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path)), "data_batch_1", "md5", "download: true")


def test_download_true_goes_through_torchvision(tmp_path, monkeypatch):
    """``download: true`` calls torchvision's CIFAR10 download (its fetcher replaced offline by one that writes
    the files), only when files are missing; a failing download is one line."""
    from torchvision.datasets import cifar

    calls = []

    def fetch(url, download_root, filename=None, md5=None, **kw):
        calls.append((url, filename))
        write_cifar10(Path(download_root))

    monkeypatch.setattr(cifar, "download_and_extract_archive", fetch)
    fed = built(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path), download=True))
    assert calls == [(cifar.CIFAR10.url, cifar.CIFAR10.filename)] and int(fed.train.sizes.sum()) == 60
    built(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path), download=True))
    assert len(calls) == 1  # the files are there: nothing fetched

    def offline(*args, **kw):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    one_line_error(
        CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path / "empty"), download=True),
        "download failed", "Network is unreachable", "cifar-10-batches-py",
    )  # fmt: skip


def test_bad_cifar_files(tmp_path):
    """With the md5 comparison bypassed (conftest), damaged files reach torchvision's parser: still one line."""
    write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    batch = folder / "data_batch_3"
    good = batch.read_bytes()
    batch.write_bytes(good[: len(good) // 2])
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path)), str(folder), "truncated")
    blob = pickle.loads(good)
    batch.write_bytes(pickle.dumps({**blob, "data": blob["data"][:, :3000]}))
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path)), str(folder), "torchvision could not read")
    blob["labels"][0] = 10
    batch.write_bytes(pickle.dumps(blob))
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path)), str(folder), "label 10 out of range")
    batch.unlink()
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path)), "first missing: data_batch_3")
    one_line_error(CIFAR10DataModule(num_clients=5, data_dir=str(tmp_path / "nowhere")), "download: true", "nowhere")


def test_bad_idx_files(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])
    one_line_error(MNISTDataModule(num_clients=5, data_dir=str(tmp_path)), "t10k-images-idx3-ubyte", "truncated")
    write_idx(path, np.zeros((20, 27, 28)))
    one_line_error(MNISTDataModule(num_clients=5, data_dir=str(tmp_path)), "t10k-images-idx3-ubyte", "shape")
    write_mnist(tmp_path)
    write_idx(tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte", np.full(60, 11))
    one_line_error(MNISTDataModule(num_clients=5, data_dir=str(tmp_path)), "train-labels-idx1-ubyte", "out of range")
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    one_line_error(MNISTDataModule(num_clients=5, data_dir=str(tmp_path)), "first missing: t10k-labels-idx1-ubyte")


def test_mnist_legacy_processed_files(tmp_path):
    """torchvision's old ``MNIST/processed/{training,test}.pt`` cache (uint8 images, labels) is read as is."""
    rng = np.random.default_rng(0)
    processed = tmp_path / "MNIST" / "processed"
    processed.mkdir(parents=True)
    parts = {}
    for name, n in (("training.pt", 40), ("test.pt", 20)):
        x, y = torch.from_numpy(rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)), torch.arange(n) % 10
        torch.save((x, y), processed / name)
        parts[name] = (x, y)
    fed = built(MNISTDataModule(num_clients=5, data_dir=str(tmp_path), seed=0))
    x, y = parts["training.pt"]
    assert row_keys(fed.train.x) == row_keys(x.float().div(255).unsqueeze(1))
    assert sorted(fed.train.y.tolist()) == sorted(y.tolist())


def test_bad_omniglot_image(tmp_path):
    write_omniglot(tmp_path, {"Alpha": 2}, {"Gamma": 1}, drawings=5)
    bad = sorted((tmp_path / "omniglot-py" / "images_evaluation" / "Gamma" / "character01").glob("*.png"))[2]
    bad.write_bytes(b"not a png")
    one_line_error(OmniglotDataModule(num_clients=3, data_dir=str(tmp_path)), bad.name, "cannot read image")
    one_line_error(OmniglotDataModule(num_clients=3, data_dir=str(tmp_path / "none")), "images_background")
