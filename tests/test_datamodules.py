"""Dataset loaders on files written in their real on-disk formats, through the public DataModules."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from data_fixtures import (  # noqa: E402
    write_cifar10,
    write_cifar100,
    write_emnist,
    write_femnist,
    write_glove,
    write_hf,
    write_idx,
    write_leaf,
    write_mnist,
    write_omniglot,
    write_sent140,
    write_shakespeare,
)
from helpers import assert_close_finite  # noqa: E402

from datamodules import (  # noqa: E402
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    FEMNISTDataModule,
    HFDataModule,
    MNISTDataModule,
    Natural,
    OmniglotDataModule,
    PerClientSplit,
    Sent140DataModule,
    ShakespeareDataModule,
    Shards,
)
from fl_lightning.errors import ConfigError  # noqa: E402


def built(dm):
    dm.setup("fit")
    return dm.federated


def row_keys(x: torch.Tensor) -> list[bytes]:
    """Samples as sortable byte strings (to compare multisets of samples independently of order)."""
    return sorted(r.numpy().tobytes() for r in x.reshape(len(x), -1).float().round(decimals=4))


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


# ---- LEAF -----------------------------------------------------------------------------------------------
def leaf_users(root: Path, split: str) -> dict[str, dict]:
    out = {}
    for f in sorted((root / split).glob("*.json")):
        out.update(json.loads(f.read_text())["user_data"])
    return out


def test_femnist_natural_keeps_users_intact(tmp_path):
    write_femnist(tmp_path, users=6)
    fed = built(FEMNISTDataModule(num_clients=6, partition=Natural(), data_dir=str(tmp_path)))
    train, test = leaf_users(tmp_path, "train"), leaf_users(tmp_path, "test")
    for c, user in enumerate(sorted(train)):  # all users kept, in id order
        x, y = fed.train.client(c)
        assert y.tolist() == train[user]["y"]
        want = torch.tensor(train[user]["x"], dtype=torch.float32)
        assert_close_finite(x.view(len(y), -1), want, rtol=1e-5, atol=1e-8)
        assert fed.test.client(c)[1].tolist() == test[user]["y"]


def test_sent140_min_samples_tokenizer_and_glove(tmp_path):
    write_sent140(tmp_path, users=8, per_user=(6, 16))
    train, test = leaf_users(tmp_path, "train"), leaf_users(tmp_path, "test")
    sizes = {u: len(train[u]["y"]) + len(test[u]["y"]) for u in train}
    eligible = sorted(u for u, n in sizes.items() if n >= 10)
    glove = tmp_path / "glove.txt"
    glove.write_text("good 1 2 3\nbad -1 -2 -3\nunrelated 9 9 9\n")
    dm = Sent140DataModule(
        num_clients=len(eligible) - 1, partition=Natural(min_samples=10), data_dir=str(tmp_path), vocab_size=50,
        glove_path=str(glove), seed=0,
    )  # fmt: skip
    fed = built(dm)
    assert fed.train.x.shape[1] == 25 and fed.train.x.dtype == torch.long and fed.num_classes == 2
    got = {int(s) for s in (fed.train.sizes + fed.test.sizes)}
    assert got <= {sizes[u] for u in eligible}  # only users with ≥ 10 tweets, each kept whole
    vocab = dm.tokenizer.get_vocab()
    assert vocab["[PAD]"] == 0 and vocab["[UNK]"] == 1
    first_user = sorted(train)[0]
    text = train[first_user]["x"][0][4]
    ids = dm.tokenizer.encode(text).ids
    assert ids[: len(text.split())][:3] == [vocab.get(w.lower(), 1) for w in text.split()][:3]
    emb = fed.extras["embedding"]
    assert emb.shape == (50, 3)
    assert emb[vocab["good"]].tolist() == [1, 2, 3] and emb[vocab["bad"]].tolist() == [-1, -2, -3]
    assert emb[0].abs().sum() == 0


def test_shakespeare_next_character(tmp_path):
    write_shakespeare(tmp_path, users=4)
    dm = ShakespeareDataModule(num_clients=4, data_dir=str(tmp_path))
    fed = built(dm)
    train = leaf_users(tmp_path, "train")
    chars = sorted(set("".join(s for u in train.values() for s in (*u["x"], *u["y"]))))
    assert fed.num_classes == len(chars) + 1
    x, y = fed.train.client(0)
    first = train[sorted(train)[0]]
    decode = {i + 1: ch for i, ch in enumerate(chars)}
    assert "".join(decode[int(i)] for i in x[0]) == first["x"][0]
    assert decode[int(y[0])] == first["y"][0]


# ---- Hugging Face ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["save_to_disk", "parquet"])
def test_hf_local_directory(tmp_path, fmt):
    import datasets

    path = write_hf(tmp_path / "hf", fmt)
    dm = HFDataModule(
        path=str(path), num_clients=4, partition=Natural(), group_column="writer", cache_dir=str(tmp_path / "cache")
    )
    fed = built(dm)
    if fmt == "parquet":
        ref_train = datasets.Dataset.from_parquet(str(path / "train-00000-of-00001.parquet"))
    else:
        ref_train = datasets.load_from_disk(str(path))["train"]
    ref_train = ref_train.cast_column("image", datasets.Image())
    imgs = np.stack([np.asarray(im) for im in ref_train["image"]])[:, None] / 255.0
    assert row_keys(fed.train.x) == row_keys(torch.tensor(imgs, dtype=torch.float32))
    assert fed.num_classes == 4
    writers = np.asarray(ref_train["writer"])
    assert sorted(dm.client_groups) == sorted(set(writers))
    for c, w in enumerate(dm.client_groups):  # natural clients = writers, whole
        assert fed.train.sizes[c] == int((writers == w).sum())
    pooled = built(HFDataModule(path=str(path), num_clients=4, partition=PerClientSplit(Shards(2), 0.25),
                                test_split=None, cache_dir=str(tmp_path / "cache")))  # fmt: skip
    assert pooled.train.sizes.sum() + pooled.test.sizes.sum() == 40


# ---- bad data: one-line errors that name the file -------------------------------------------------------
def one_line_error(dm, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        dm.setup("fit")
    msg = str(info.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    return msg


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


def test_bad_leaf_files(tmp_path):
    write_femnist(tmp_path, users=4)
    f = sorted((tmp_path / "train").glob("*.json"))[0]
    text = f.read_text()
    f.write_text(text[: len(text) // 2])
    one_line_error(FEMNISTDataModule(num_clients=4, data_dir=str(tmp_path)), f.name, "truncated")
    blob = json.loads(text)
    user = blob["users"][0]
    blob["user_data"][user]["x"][0] = blob["user_data"][user]["x"][0][:700]
    f.write_text(json.dumps(blob))
    one_line_error(FEMNIST := FEMNISTDataModule(num_clients=4, data_dir=str(tmp_path)), f.name, user, "784")
    assert FEMNIST.federated is None
    blob = json.loads(text)
    blob["user_data"][user]["y"][0] = 70
    f.write_text(json.dumps(blob))
    one_line_error(FEMNISTDataModule(num_clients=4, data_dir=str(tmp_path)), f.name, "label 70 out of range")


def test_empty_client_after_filtering(tmp_path):
    train = {"a": ([[0.0] * 784] * 5, [36] * 5), "b": ([[0.0] * 784] * 5, [1] * 5), "c": ([[0.0] * 784] * 2, [37] * 2)}
    test = {"a": ([[0.0] * 784], [36]), "b": ([[0.0] * 784], [1]), "c": ([[0.0] * 784] * 3, [37] * 3)}
    write_leaf(tmp_path, train, test)
    # user b has no letters left after keeping classes 36-45; with min_samples 4 only a and c qualify
    msg = one_line_error(
        FEMNISTDataModule(num_clients=3, data_dir=str(tmp_path), classes=list(range(36, 46)),
                          partition=Natural(min_samples=4)), "only 2 owners have ≥ 4 samples",
    )  # fmt: skip
    assert "num_clients=3" in msg
    # a client whose user has test samples only: an empty training client
    write_leaf(tmp_path, {"a": train["a"], "c": ([], [])}, {"a": test["a"], "c": test["c"]})
    one_line_error(FEMNISTDataModule(num_clients=2, data_dir=str(tmp_path)), "no training samples", "[1]")


def test_sent140_glove_initialises_the_network_embedding(tmp_path):
    from conftest import fit

    from fl_lightning.algorithms import FedAvg
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import Sent140LSTM

    write_sent140(tmp_path, users=4, per_user=(6, 10))
    glove = tmp_path / "glove.txt"
    glove.write_text("good 1 2 3\nbad -1 -2 -3\n")
    dm = Sent140DataModule(num_clients=4, partition=Natural(), data_dir=str(tmp_path), vocab_size=40,
                           glove_path=str(glove), participation=1.0, seed=0)  # fmt: skip
    module = FederatedModule(FedAvg(), Sent140LSTM(vocab_size=40, embed_dim=3, hidden=4, fc=4), lr=1e-9)
    fit(module, dm, rounds=1)
    weight = module.net.body.embedding.weight.detach()
    vocab = dm.tokenizer.get_vocab()
    assert_close_finite(weight[vocab["good"]], torch.tensor([1.0, 2.0, 3.0]), rtol=1e-5, atol=1e-6)
    assert_close_finite(weight[vocab["bad"]], torch.tensor([-1.0, -2.0, -3.0]), rtol=1e-5, atol=1e-6)


def test_femnist_letters_train_and_digit_clients_are_new(tmp_path):
    write_femnist(tmp_path, users=6, per_user=(40, 60), classes=[*range(10), *range(36, 46)])
    dm = FEMNISTDataModule(
        num_clients=3, partition=PerClientSplit(Natural(), 0.1), data_dir=str(tmp_path), classes=list(range(36, 46)),
        transfer_classes=list(range(10)), transfer_clients=2, transfer_partition=Shards(5), seed=0,
    )  # fmt: skip
    fed = built(dm)
    ys = [y for split in ("train", "test") for u in leaf_users(tmp_path, split).values() for y in u["y"]]
    letters, digits = sum(36 <= y <= 45 for y in ys), sum(y < 10 for y in ys)
    new = dm.new_clients
    # the 3 training clients are 3 of the 6 writers (letters only, relabelled 0-9); all digits go to new clients
    assert fed.train.y.max() <= 9 and fed.train.x.shape[0] + fed.test.x.shape[0] <= letters
    assert new.train.x.shape[0] + new.test.x.shape[0] == digits
    for c in range(2):
        assert len(set(new.train.client(c)[1].tolist())) == 5
        assert set(new.test.client(c)[1].tolist()) <= set(new.train.client(c)[1].tolist())


# ---- GloVe ----------------------------------------------------------------------------------------------
def glove_vectors(path: Path) -> dict[str, list[float]]:
    """The test's own reading of a GloVe text file: ``word v1 … vd`` per line."""
    out = {}
    for line in path.read_text(encoding="utf8").splitlines():
        word, *values = line.split(" ")
        out[word] = [float(v) for v in values]
    return out


def test_glove_reader_and_its_errors(tmp_path):
    from datamodules.text import load_glove

    path = write_glove(tmp_path / "glove.6B.16d.txt", dim=16)
    ref = glove_vectors(path)
    vocab = {"[PAD]": 0, "[UNK]": 1, "good": 2, "zebra": 3, "notinglove": 4}
    matrix, found = load_glove(path, vocab, rows=8)
    assert matrix.shape == (8, 16) and matrix.dtype == torch.float32 and found == 2
    assert torch.equal(matrix[2], torch.tensor(ref["good"])) and torch.equal(matrix[3], torch.tensor(ref["zebra"]))
    assert matrix[[0, 1, 4, 5, 6, 7]].abs().sum() == 0  # padding, unknown, words GloVe lacks, unused rows
    with pytest.raises(ConfigError) as info:
        load_glove(tmp_path / "glove.6B.300d.txt", vocab)
    assert "glove.6B.300d.txt" in str(info.value) and "\n" not in str(info.value)
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join([lines[0], "good 1.0 oops" + " 0.5" * 14, *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: not a number in the vector of 'good'"):
        load_glove(bad, vocab)
    bad.write_text("\n".join([lines[0], "good 1.0 2.0", *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: 2 values for 'good', expected 16"):
        load_glove(bad, vocab)


def sent140_table1_run(tmp_path: Path, *extra: str) -> tuple[dict, Sent140DataModule]:
    """Two FedAvg rounds of ``configs/table1/sent140_183x2.yaml`` on the fake LEAF Sent140 + GloVe fixture;
    returns the last checkpoint's state dict and the data module built from the same arguments."""
    from data_fixtures import make_fixture

    from datamodules.partition_report import parse
    from fl_lightning.cli import train_config

    root = Path(__file__).resolve().parents[1]
    config = root / "configs" / "table1" / "sent140_183x2.yaml"
    args = [*make_fixture("sent140_183x2", tmp_path), *extra]
    train_config(
        [config, root / "configs" / "methods" / "fedavg.yaml"],
        [*args, "--trainer.max_steps", "2", "--trainer.logger", "false", "--checkpoint_every", "1",
         "--model.eval_last", "1"],
        run_dir=tmp_path / "run",
    )  # fmt: skip
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    dm = parse(["--config", str(config), *args])[0]  # train.py's arguments; the report ignores --model.*
    dm.setup("fit")
    return state["state_dict"], dm


def test_sent140_table1_config_trains_with_the_frozen_glove_embedding(tmp_path):
    state, dm = sent140_table1_run(tmp_path)
    glove = glove_vectors(Path(dm.glove_path))
    weight = state["net.body.embedding.weight"]
    vocab = dm.tokenizer.get_vocab()
    used = [w for w in vocab if w in glove]
    assert len(used) >= 10 and weight.shape == (64, 16)
    for w in used:  # after two rounds at lr 0.01 the GloVe rows are still exactly GloVe's
        assert torch.equal(weight[vocab[w]], torch.tensor(glove[w])), w
    assert weight[vocab["[PAD]"]].abs().sum() == 0 and weight[vocab["[UNK]"]].abs().sum() == 0
    # the control: the same run with a trainable embedding moves the rows of the tweets' words
    moved, _ = sent140_table1_run(tmp_path / "trainable", "--model.network.init_args.freeze_embedding", "false")
    changed = [w for w in used if not torch.equal(moved["net.body.embedding.weight"][vocab[w]], weight[vocab[w]])]
    assert changed


def test_sent140_table1_config_names_a_missing_glove_file(tmp_path):
    from data_fixtures import make_fixture

    from fl_lightning.cli import train_config

    missing = tmp_path / "glove.6B.300d.txt"
    args = [*make_fixture("sent140_183x2", tmp_path), "--data.init_args.glove_path", str(missing)]
    with pytest.raises(ConfigError) as info:
        train_config(["configs/table1/sent140_183x2.yaml", "configs/methods/fedavg.yaml"], args, run_dir=tmp_path)
    assert str(missing) in str(info.value) and "\n" not in str(info.value)
