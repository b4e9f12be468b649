"""Tiny datasets written in their real on-disk formats, for offline tests and dry runs.

Every ``write_*`` function writes the files a real download or LEAF preprocessing would produce (pickled
CIFAR batches, IDX files, Omniglot PNG folders, LEAF JSON, a GloVe text file, an HF ``save_to_disk`` or
parquet folder), with random content. ``make_fixture(column, tmp_path)`` writes the data for one
``configs/table1`` column and returns the ``train.py`` overrides that point the column's config at it with
few clients::

    args = ["--config", "configs/table1/cifar10_100x2.yaml", "--config", method_yaml,
            *make_fixture("cifar10_100x2", tmp_path), "--trainer.max_steps", "1"]
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import numpy as np

# ---- CIFAR ----------------------------------------------------------------------------------------------


def skip_cifar_md5(monkeypatch) -> None:
    """Let ``torchvision.datasets.CIFAR10``/``CIFAR100`` read CIFAR files written by a test.

    torchvision compares the md5 of every CIFAR file with the published archive's (``cifar.check_integrity``),
    which files written here cannot match. This replaces only that comparison with an existence check;
    everything after it (unpickling, reshaping, the meta file's class names) is torchvision's own code.
    ``tests/conftest.py`` applies it for the whole session; a test that wants the real check restores
    ``torchvision.datasets.utils.check_integrity``.
    """
    from torchvision.datasets import cifar

    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))



def _images(rng: np.random.Generator, labels: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 images whose mean brightness depends on the class (so the classes are learnable)."""
    base = rng.integers(0, 96, size=(len(labels), *shape))
    return (base + (labels.reshape(-1, *[1] * len(shape)) * 13) % 160).astype(np.uint8)


def _labels(num_classes: int, per_class: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.repeat(np.arange(num_classes), per_class))


def write_cifar10(root: Path, train_per_class: int = 6, test_per_class: int = 2, seed: int = 0) -> Path:
    """``root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    y = _labels(10, train_per_class, rng)
    x = _images(rng, y, (3072,))
    for i, idx in enumerate(np.array_split(np.arange(len(y)), 5), 1):
        batch = {"batch_label": f"training batch {i} of 5", "labels": y[idx].tolist(), "data": x[idx]}
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch))
    yt = _labels(10, test_per_class, rng)
    test = {"batch_label": "testing batch 1 of 1", "labels": yt.tolist(), "data": _images(rng, yt, (3072,))}
    (folder / "test_batch").write_bytes(pickle.dumps(test))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names, "num_vis": 3072}))
    return Path(root)


def write_cifar100(root: Path, train_per_class: int = 3, test_per_class: int = 1, seed: int = 0) -> Path:
    """``root/cifar-100-python/{train, test, meta}`` with fine and coarse labels."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, per_class in (("train", train_per_class), ("test", test_per_class)):
        y = _labels(100, per_class, rng)
        blob = {"filenames": [f"{i}.png" for i in range(len(y))], "fine_labels": y.tolist(),
                "coarse_labels": (y // 5).tolist(), "data": _images(rng, y, (3072,))}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(blob))
    meta = {"fine_label_names": [f"c{i}" for i in range(100)], "coarse_label_names": [f"s{i}" for i in range(20)]}
    (folder / "meta").write_bytes(pickle.dumps(meta))
    return Path(root)


# ---- IDX (MNIST, EMNIST) -------------------------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """LeCun's IDX format: ``00 00 08 ndim``, big-endian int32 dims, then the uint8 data."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    raw = bytes([0, 0, 0x08, a.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in a.shape) + a.tobytes()
    path = Path(str(path) + ".gz") if gz else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def write_mnist(root: Path, train_per_class: int = 6, test_per_class: int = 2, seed: int = 0, gz: bool = False) -> Path:
    """``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / "MNIST" / "raw"
    for prefix, per_class in (("train", train_per_class), ("t10k", test_per_class)):
        y = _labels(10, per_class, rng)
        write_idx(raw / f"{prefix}-images-idx3-ubyte", _images(rng, y, (28, 28)), gz)
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", y, gz)
    return Path(root)


def write_emnist(root: Path, split: str = "letters", train_per_class: int = 4, test_per_class: int = 2, seed: int = 0):
    """``root/EMNIST/raw/emnist-<split>-{train,test}-...-ubyte``; letters use labels 1..26 as EMNIST does."""
    rng = np.random.default_rng(seed)
    raw = Path(root) / "EMNIST" / "raw"
    classes, offset = (26, 1) if split == "letters" else (10, 0)
    for part, per_class in (("train", train_per_class), ("test", test_per_class)):
        y = _labels(classes, per_class, rng)
        write_idx(raw / f"emnist-{split}-{part}-images-idx3-ubyte", _images(rng, y, (28, 28)))
        write_idx(raw / f"emnist-{split}-{part}-labels-idx1-ubyte", y + offset)
    return Path(root)


# ---- Omniglot ------------------------------------------------------------------------------------------


def write_omniglot(
    root: Path,
    background: dict[str, int] | None = None,
    evaluation: dict[str, int] | None = None,
    drawings: int = 20,
    size: int = 105,
    seed: int = 0,
) -> Path:
    """``root/omniglot-py/images_{background,evaluation}/<alphabet>/character<NN>/<id>_<NN>.png`` (grey PNGs,
    white background, black strokes as in the real set). ``background``/``evaluation``: alphabet -> characters."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    background = background if background is not None else {"Alpha": 3, "Beta": 2}
    evaluation = evaluation if evaluation is not None else {"Gamma": 2}
    char_id = 0
    for part, alphabets in (("images_background", background), ("images_evaluation", evaluation)):
        for alphabet, n_chars in alphabets.items():
            for c in range(n_chars):
                char_id += 1
                folder = Path(root) / "omniglot-py" / part / alphabet / f"character{c + 1:02d}"
                folder.mkdir(parents=True, exist_ok=True)
                for d in range(drawings):
                    img = np.full((size, size), 255, np.uint8)
                    r = rng.integers(0, size - 10, 2)
                    img[r[0] : r[0] + 10, r[1] : r[1] + 10] = 0
                    Image.fromarray(img, mode="L").save(folder / f"{char_id:04d}_{d + 1:02d}.png")
    return Path(root)


# ---- LEAF JSON -----------------------------------------------------------------------------------------


def write_leaf(root: Path, train: dict[str, tuple[list, list]], test: dict[str, tuple[list, list]], files: int = 2):
    """LEAF ``root/train/*.json`` and ``root/test/*.json``: users spread over ``files`` files per split."""
    for split, users in (("train", train), ("test", test)):
        folder = Path(root) / split
        folder.mkdir(parents=True, exist_ok=True)
        names = list(users)
        for k in range(files):
            chunk = names[k::files]
            blob = {
                "users": chunk,
                "num_samples": [len(users[u][1]) for u in chunk],
                "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in chunk},
            }
            (folder / f"all_data_{k}_niid_{split}.json").write_text(json.dumps(blob))
    return Path(root)


def _split_user(xs: list, ys: list, test_fraction: float) -> tuple[tuple[list, list], tuple[list, list]]:
    n_test = max(1, int(round(test_fraction * len(ys))))
    return (xs[n_test:], ys[n_test:]), (xs[:n_test], ys[:n_test])


def write_femnist(
    root: Path, users: int = 6, per_user: tuple[int, int] = (20, 40), classes: list[int] | None = None, seed: int = 0
) -> Path:
    """LEAF FEMNIST: 784 floats in [0, 1] per image, labels 0..61, 90/10 per-user split (LEAF ``-tf 0.9``)."""
    rng = np.random.default_rng(seed)
    classes = classes if classes is not None else list(range(62))
    train, test = {}, {}
    for u in range(users):
        n = int(rng.integers(*per_user))
        y = rng.choice(classes, n).tolist()
        x = (rng.random((n, 784)) * 0.5 + (np.asarray(y)[:, None] % 10) / 20).round(3).tolist()
        train[f"f{u:04d}_00"], test[f"f{u:04d}_00"] = _split_user(x, y, 0.1)
    return write_leaf(root, train, test)


_WORDS = "good bad happy sad love hate great awful fun boring nice terrible day night work home".split()


def write_sent140(root: Path, users: int = 8, per_user: tuple[int, int] = (6, 16), seed: int = 0) -> Path:
    """LEAF Sent140: x = ``[id, date, query, user, text]``, y in {0, 1}, 80/20 per-user split (``-tf 0.8``)."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for u in range(users):
        n = int(rng.integers(*per_user))
        name = f"user{u}"
        y = rng.integers(0, 2, n).tolist()
        x = [
            [str(1000 + i), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", name,
             " ".join(rng.choice(_WORDS[label::2], int(rng.integers(3, 30)))) + " @friend!"]
            for i, label in enumerate(y)
        ]  # fmt: skip
        train[name], test[name] = _split_user(x, y, 0.2)
    return write_leaf(root, train, test)


def write_glove(path: Path, words: list[str] | None = None, dim: int = 16, seed: int = 0) -> Path:
    """A GloVe text file in Stanford's format (``glove.6B.300d.txt``): one ``word v1 … vd`` line per word,
    single spaces, five decimals. Default words: the tweet words of :func:`write_sent140` plus a few that
    no tweet uses (real GloVe holds far more words than a vocabulary)."""
    rng = np.random.default_rng(seed)
    words = words if words is not None else [*_WORDS, "the", "of", "zebra"]
    lines = [w + " " + " ".join(f"{v:.5f}" for v in rng.standard_normal(dim)) for w in words]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf8")
    return path


def write_shakespeare(root: Path, users: int = 4, per_user: tuple[int, int] = (6, 12), seed: int = 0) -> Path:
    """LEAF Shakespeare: x = 80-character strings, y = the next character."""
    rng = np.random.default_rng(seed)
    text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer. " * 4
    train, test = {}, {}
    for u in range(users):
        n = int(rng.integers(*per_user))
        starts = rng.integers(0, len(text) - 81, n)
        x, y = [text[s : s + 80] for s in starts], [text[s + 80] for s in starts]
        train[f"ROLE_{u}"], test[f"ROLE_{u}"] = _split_user(x, y, 0.2)
    return write_leaf(root, train, test)


# ---- Hugging Face --------------------------------------------------------------------------------------


def write_hf(path: Path, fmt: str = "save_to_disk", train: int = 40, test: int = 10, groups: int = 4, seed: int = 0):
    """An image-classification ``DatasetDict`` (``image``: 8×8 grey PIL image, ``label``: ClassLabel of 4,
    ``writer``: string) as a ``save_to_disk`` folder or as ``{train,test}-00000-of-00001.parquet`` files."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(seed)

    def make(n: int):
        y = rng.integers(0, 4, n)
        imgs = [Image.fromarray(a, mode="L") for a in _images(rng, y, (8, 8))]
        writers = [f"w{int(g)}" for g in rng.integers(0, groups, n)]
        feats = datasets.Features(
            {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=4), "writer": datasets.Value("string")}
        )
        return datasets.Dataset.from_dict({"image": imgs, "label": y.tolist(), "writer": writers}, features=feats)

    dsd = datasets.DatasetDict({"train": make(train), "test": make(test)})
    path = Path(path)
    if fmt == "save_to_disk":
        dsd.save_to_disk(str(path))
    else:
        path.mkdir(parents=True, exist_ok=True)
        for split, ds in dsd.items():
            ds.to_parquet(str(path / f"{split}-00000-of-00001.parquet"))
    return path


# ---- Table 1 columns -----------------------------------------------------------------------------------

TABLE1_COLUMNS = (
    "cifar10_100x2",
    "cifar10_100x5",
    "cifar10_1000x2",
    "cifar100_100x5",
    "cifar100_100x20",
    "femnist_150x3",
    "sent140_183x2",
)


def make_fixture(column: str, tmp_path: Path) -> list[str]:
    """Write a tiny fixture for ``configs/table1/<column>.yaml`` and return the overrides that use it.

    The overrides set ``data_dir``, a handful of clients (``num_clients·S`` divides the class count for
    shards) and, for the lognormal and natural partitions, sizes that fit the fixture. Training length is
    left to the caller (add ``--trainer.max_steps 1`` for a dry run).
    """
    root = Path(tmp_path) / f"data_{column}"
    d = "--data.init_args."
    if column.startswith("cifar10_"):
        clients = {"cifar10_100x2": 5, "cifar10_100x5": 4, "cifar10_1000x2": 10}[column]
        write_cifar10(root, train_per_class=6, test_per_class=2)
        return [d + "data_dir", str(root), d + "num_clients", str(clients), d + "participation", "0.5"]
    if column.startswith("cifar100_"):
        clients = {"cifar100_100x5": 20, "cifar100_100x20": 5}[column]
        write_cifar100(root, train_per_class=2, test_per_class=1)
        return [d + "data_dir", str(root), d + "num_clients", str(clients), d + "participation", "0.2"]
    if column == "femnist_150x3":
        write_femnist(root, users=10, per_user=(30, 50), classes=[0, 3, *range(36, 46)])
        p = d + "partition.init_args."
        return [d + "data_dir", str(root), d + "num_clients", "6", d + "participation", "0.5",
                p + "mean_samples", "14", p + "min_samples", "6"]  # fmt: skip
    if column == "sent140_183x2":
        write_sent140(root, users=8, per_user=(6, 16))
        glove = write_glove(root / "glove.6B.16d.txt", dim=16)
        return [d + "data_dir", str(root), d + "num_clients", "4", d + "participation", "0.5",
                d + "partition.init_args.min_samples", "8", d + "vocab_size", "64", d + "glove_path", str(glove),
                "--model.network.init_args.vocab_size", "64", "--model.network.init_args.embed_dim", "16"]  # fmt: skip
    raise KeyError(f"unknown Table 1 column {column!r}; known: {', '.join(TABLE1_COLUMNS)}")
