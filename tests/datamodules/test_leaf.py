"""Dataset loaders on files written in their real on-disk formats, through the public DataModules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from datamodules import FEMNISTDataModule, Natural, PerClientSplit, Sent140DataModule, ShakespeareDataModule, Shards
from tests.helpers.asserts import assert_close_finite
from tests.helpers.data_fixtures import write_femnist, write_leaf, write_sent140, write_shakespeare
from tests.helpers.loaders import built, one_line_error


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


@pytest.mark.parametrize("count", [120, pytest.param(3000, marks=pytest.mark.slow)])
def test_femnist_reads_thousands_of_users_over_several_files_one_file_at_a_time(count: int, tmp_path):
    """``count`` writers over 4 LEAF files per split: every user's data arrive (numpy reference), and reading
    converts each file's users before the next file is parsed: the peak of Python allocations is below half of what
    holding every file's parsed JSON takes (tracemalloc)."""
    import tracemalloc

    import numpy as np

    from datamodules.leaf import read_leaf_split

    rng = np.random.default_rng(0)
    users = [f"f{u:05d}_00" for u in range(count)]
    images = {u: rng.integers(0, 2, size=(3, 784)).astype(float) / 2 for u in users}
    labels = {u: rng.integers(0, 62, size=3).tolist() for u in users}
    write_leaf(tmp_path, {u: (images[u][:2].tolist(), labels[u][:2]) for u in users},
               {u: (images[u][2:].tolist(), labels[u][2:]) for u in users}, files=4)  # fmt: skip

    def peak(fn) -> int:
        tracemalloc.start()
        kept = fn()
        size = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del kept
        return size

    convert = lambda xs, ys, user, file: (torch.tensor(xs, dtype=torch.float32), torch.tensor(ys))  # noqa: E731
    streamed = peak(lambda: read_leaf_split(tmp_path / "train", convert))
    whole = peak(lambda: read_leaf_split(tmp_path / "train"))
    assert streamed < 0.5 * whole

    fed = built(FEMNISTDataModule(num_clients=count, partition=Natural(), data_dir=str(tmp_path)))
    for c in (0, count // 2, count - 1):
        x, y = fed.train.client(c)
        np.testing.assert_array_equal(x.view(2, 784).numpy(), images[users[c]][:2])
        assert y.tolist() == labels[users[c]][:2] and fed.test.client(c)[1].tolist() == labels[users[c]][2:]
