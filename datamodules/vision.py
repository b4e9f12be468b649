"""Image datasets in their published on-disk formats, loaded once into tensors.

``download: true`` fetches the files with torchvision when online; otherwise the files must already be in
``data_dir`` in torchvision's layout. The readers below parse the files themselves (pickles, IDX, PNG
folders), so a damaged file gives a one-line ``ConfigError`` naming the file and the problem.

Layouts under ``data_dir``:

- CIFAR-10: ``cifar-10-batches-py/{data_batch_1..5, test_batch}``;
- CIFAR-100: ``cifar-100-python/{train, test}``;
- MNIST: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``;
- EMNIST: ``EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte[.gz]``;
- Omniglot: ``omniglot-py/images_{background,evaluation}/<alphabet>/<character>/*.png``.
"""

from __future__ import annotations

import gzip
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from datamodules.augment import CropFlip, normalize
from datamodules.common import PartitionedDataModule, Pools
from datamodules.partition import Natural, Partitioner
from fl_lightning.client_data import FederatedData
from fl_lightning.errors import ConfigError

# FedRep's normalisation constants (spec 000 §8.2).
CIFAR10_MEAN, CIFAR10_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR100_MEAN, CIFAR100_STD = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)


def _missing(name: str, expected: Path, hint: str) -> ConfigError:
    return ConfigError(
        f"{name} not found: expected {expected} ({hint}); put the files there or set data.init_args.download: true"
    )


def _download(fetch: Callable[[], object], name: str, expected: Path) -> None:
    try:
        fetch()
    except Exception as exc:  # network errors come in many types
        msg = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"{name}: download failed ({type(exc).__name__}: {msg}); put the files at {expected}"
        ) from None


def _check_labels(y: np.ndarray, num_classes: int, path: Path, lo: int = 0) -> None:
    if y.size and (y.min() < lo or y.max() >= num_classes + lo):
        bad = int(y.min()) if y.min() < lo else int(y.max())
        raise ConfigError(f"{path}: label {bad} out of range {lo}..{num_classes + lo - 1}")


# ---- CIFAR ----------------------------------------------------------------------------------------------
def read_cifar_pickle(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One pickled CIFAR batch: images ``[N, 3, 32, 32]`` uint8 and labels ``[N]``."""
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="latin1")
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise ConfigError(f"{path}: truncated or not a CIFAR pickle ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict) or "data" not in d or label_key not in d:
        raise ConfigError(f"{path}: not a CIFAR batch (needs keys 'data' and '{label_key}')")
    x, y = np.asarray(d["data"]), np.asarray(d[label_key], dtype=np.int64)
    if x.ndim != 2 or x.shape[1] != 3072:
        raise ConfigError(f"{path}: 'data' has shape {list(x.shape)}, expected [N, 3072]")
    if len(y) != len(x):
        raise ConfigError(f"{path}: {len(x)} images but {len(y)} labels")
    _check_labels(y, num_classes, path)
    return x.astype(np.uint8).reshape(-1, 3, 32, 32), y


class _CifarBase(PartitionedDataModule):
    folder, train_files, test_files, label_key, num_classes, mean, std, name = "", (), (), "", 0, (), (), ""
    tv_class = ""

    def __init__(
        self,
        num_clients: int = 100,
        partition: Partitioner | None = None,
        data_dir: str = "data",
        download: bool = False,
        augment: bool = True,
        classes: list[int] | None = None,
        holdout_clients: int = 0,
        transfer_classes: list[int] | None = None,
        transfer_clients: int = 0,
        transfer_partition: Partitioner | None = None,
        write_report: bool = True,
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            num_clients, partition, classes, holdout_clients, transfer_classes, transfer_clients,
            transfer_partition, write_report, clients_per_round, participation, seed,
        )  # fmt: skip
        self.data_dir, self.download, self.augment = Path(data_dir), download, augment

    def load(self) -> Pools:
        root = self.data_dir / self.folder
        files = [root / f for f in (*self.train_files, *self.test_files)]
        if not all(f.exists() for f in files) and self.download:
            import torchvision

            cls = getattr(torchvision.datasets, self.tv_class)
            _download(lambda: cls(str(self.data_dir), train=True, download=True), self.name, root)
        missing = [f for f in files if not f.exists()]
        if missing:
            hint = f"the python-version pickles {', '.join(self.train_files + self.test_files)}"
            raise _missing(self.name, root, f"{hint}; first missing: {missing[0].name}")
        parts = [read_cifar_pickle(f, self.label_key, self.num_classes) for f in files]
        n_tr = len(self.train_files)
        x_tr = np.concatenate([p[0] for p in parts[:n_tr]])
        y_tr = np.concatenate([p[1] for p in parts[:n_tr]])
        x_te = np.concatenate([p[0] for p in parts[n_tr:]])
        y_te = np.concatenate([p[1] for p in parts[n_tr:]])

        def prep(x: np.ndarray) -> Tensor:
            return normalize(torch.from_numpy(x).float().div_(255), self.mean, self.std)

        aug = CropFlip(4, True, self.mean, self.std) if self.augment else None
        return Pools(
            prep(x_tr), torch.from_numpy(y_tr), prep(x_te), torch.from_numpy(y_te), self.num_classes, augment=aug
        )


class CIFAR10DataModule(_CifarBase):
    """CIFAR-10 (50,000 train / 10,000 test, 32×32 RGB), normalised with FedRep's constants; random crop
    (padding 4) and horizontal flip on the training device when ``augment`` (spec 000 §8.2).

    Default partition: ``Shards(2)`` (FedRep Table 1). See :class:`PartitionedDataModule` for new clients.
    """

    folder, name, tv_class = "cifar-10-batches-py", "CIFAR-10", "CIFAR10"
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_files = ("test_batch",)
    label_key, num_classes, mean, std = "labels", 10, CIFAR10_MEAN, CIFAR10_STD


class CIFAR100DataModule(_CifarBase):
    """CIFAR-100 (fine labels, 100 classes), normalised with FedRep's CIFAR-100 constants; otherwise as
    :class:`CIFAR10DataModule`. Spec 004's transfer split: ``transfer_classes: [80, …, 99]``."""

    folder, name, tv_class = "cifar-100-python", "CIFAR-100", "CIFAR100"
    train_files, test_files = ("train",), ("test",)
    label_key, num_classes, mean, std = "fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD


# ---- MNIST / EMNIST (IDX) ------------------------------------------------------------------------------
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format), optionally gzipped: magic ``00 00 type ndim``, big-endian dims."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise ConfigError(f"{path}: cannot read ({type(exc).__name__}: {exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(f"{path}: not an IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ConfigError(f"{path}: truncated IDX header")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    need = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - header != need:
        raise ConfigError(
            f"{path}: truncated or oversized IDX file: header says {dims} ({need} bytes), file has {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)


def _find_idx(raw: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (raw / name).exists():
            return raw / name
    return None


class _IdxBase(PartitionedDataModule):
    name = ""

    def _read_pair(self, raw: Path, prefix: str, num_classes: int, label_offset: int = 0) -> tuple[Tensor, Tensor]:
        img_path = _find_idx(raw, f"{prefix}-images-idx3-ubyte")
        lab_path = _find_idx(raw, f"{prefix}-labels-idx1-ubyte")
        if img_path is None or lab_path is None:
            raise _missing(self.name, raw, f"IDX files {prefix}-images-idx3-ubyte and {prefix}-labels-idx1-ubyte")
        x, y = read_idx(img_path), read_idx(lab_path).astype(np.int64)
        if x.ndim != 3 or x.shape[1:] != (28, 28):
            raise ConfigError(f"{img_path}: images have shape {list(x.shape)}, expected [N, 28, 28]")
        if y.ndim != 1 or len(y) != len(x):
            raise ConfigError(f"{lab_path}: labels have shape {list(y.shape)}, expected [{len(x)}]")
        _check_labels(y, num_classes, lab_path, label_offset)
        return torch.from_numpy(x.copy()).float().div_(255).unsqueeze(1), torch.from_numpy(y - label_offset)


class MNISTDataModule(_IdxBase):
    """MNIST (60,000 train / 10,000 test, 28×28), pixels in [0, 1], shape ``[N, 1, 28, 28]``."""

    name = "MNIST"

    def __init__(
        self,
        num_clients: int = 100,
        partition: Partitioner | None = None,
        data_dir: str = "data",
        download: bool = False,
        classes: list[int] | None = None,
        holdout_clients: int = 0,
        transfer_classes: list[int] | None = None,
        transfer_clients: int = 0,
        transfer_partition: Partitioner | None = None,
        write_report: bool = True,
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            num_clients, partition, classes, holdout_clients, transfer_classes, transfer_clients,
            transfer_partition, write_report, clients_per_round, participation, seed,
        )  # fmt: skip
        self.data_dir, self.download = Path(data_dir), download

    def load(self) -> Pools:
        raw = self.data_dir / "MNIST" / "raw"
        if self.download and _find_idx(raw, "t10k-labels-idx1-ubyte") is None:
            import torchvision

            _download(lambda: torchvision.datasets.MNIST(str(self.data_dir), download=True), self.name, raw)
        x_tr, y_tr = self._read_pair(raw, "train", 10)
        x_te, y_te = self._read_pair(raw, "t10k", 10)
        return Pools(x_tr, y_tr, x_te, y_te, 10)


class EMNISTDataModule(_IdxBase):
    """EMNIST ``letters`` (26 classes; the files' labels 1–26 become 0–25) or ``digits`` (10 classes).

    The IDX images of EMNIST are stored transposed; they are turned upright here. Pixels in [0, 1].
    """

    name = "EMNIST"

    def __init__(
        self,
        num_clients: int = 100,
        partition: Partitioner | None = None,
        split: Literal["letters", "digits"] = "letters",
        data_dir: str = "data",
        download: bool = False,
        classes: list[int] | None = None,
        holdout_clients: int = 0,
        transfer_classes: list[int] | None = None,
        transfer_clients: int = 0,
        transfer_partition: Partitioner | None = None,
        write_report: bool = True,
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            num_clients, partition, classes, holdout_clients, transfer_classes, transfer_clients,
            transfer_partition, write_report, clients_per_round, participation, seed,
        )  # fmt: skip
        if split not in ("letters", "digits"):
            raise ConfigError(f"EMNISTDataModule.split must be 'letters' or 'digits', got {split!r}")
        self.split, self.data_dir, self.download = split, Path(data_dir), download

    def load(self) -> Pools:
        raw = self.data_dir / "EMNIST" / "raw"
        prefix = f"emnist-{self.split}"
        if self.download and _find_idx(raw, f"{prefix}-test-labels-idx1-ubyte") is None:
            import torchvision

            fetch = lambda: torchvision.datasets.EMNIST(str(self.data_dir), self.split, download=True)  # noqa: E731
            _download(fetch, self.name, raw)
        num_classes, offset = (26, 1) if self.split == "letters" else (10, 0)
        x_tr, y_tr = self._read_pair(raw, f"{prefix}-train", num_classes, offset)
        x_te, y_te = self._read_pair(raw, f"{prefix}-test", num_classes, offset)
        return Pools(x_tr.transpose(-1, -2).contiguous(), y_tr, x_te.transpose(-1, -2).contiguous(), y_te, num_classes)


# ---- Omniglot (PNG folders) ----------------------------------------------------------------------------
def read_omniglot(root: Path, image_size: int, invert: bool) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """All drawings of both sets: images ``[N, 1, s, s]`` in [0, 1], character ids, alphabet ids, alphabet
    names ("background/Latin"). Characters and alphabets are numbered in sorted path order, background
    set first."""
    from PIL import Image, UnidentifiedImageError

    images, chars, alphas, names = [], [], [], []
    char_id = 0
    for part in ("images_background", "images_evaluation"):
        for alphabet in sorted(p for p in (root / part).iterdir() if p.is_dir()):
            names.append(f"{part.removeprefix('images_')}/{alphabet.name}")
            for character in sorted(p for p in alphabet.iterdir() if p.is_dir()):
                files = sorted(character.glob("*.png"))
                if not files:
                    raise ConfigError(f"{character}: character folder has no PNG drawings")
                batch = []
                for f in files:
                    try:
                        with Image.open(f) as im:
                            batch.append(np.asarray(im.convert("L"), dtype=np.uint8))
                    except (UnidentifiedImageError, OSError) as exc:
                        raise ConfigError(f"{f}: cannot read image ({type(exc).__name__}: {exc})") from None
                shapes = {b.shape for b in batch}
                if len(shapes) > 1:
                    raise ConfigError(f"{character}: drawings have different sizes {sorted(shapes)}")
                x = torch.from_numpy(np.stack(batch)).float().div_(255).unsqueeze(1)
                if x.shape[-2:] != (image_size, image_size):
                    x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True)
                images.append(1 - x if invert else x)
                chars += [char_id] * len(files)
                alphas += [len(names) - 1] * len(files)
                char_id += 1
    if not images:
        raise ConfigError(f"{root}: no alphabets found in images_background/ or images_evaluation/")
    return torch.cat(images), torch.tensor(chars), torch.tensor(alphas), names


class OmniglotDataModule(PartitionedDataModule):
    """Omniglot, background + evaluation sets: 1,623 characters (classes) in 50 alphabets, 20 drawings
    each. The alphabet is the natural client id (PerFedSI, spec 002 §4.2).

    Default partition: ``Natural(test_fraction=0.2, stratify=True)``: each alphabet's characters are cut
    per character over ``num_clients / 50`` clients, and each client's drawings of a character are split
    80/20 (at least one test drawing): 16/4 drawings per character at M = 50, 4/1 at M = 200, 1/1 at
    M = 500. Images are resized to ``image_size`` and inverted (strokes = 1) when ``invert``.
    ``federated.extras["alphabet"]`` is each client's alphabet id.
    """

    def __init__(
        self,
        num_clients: int = 50,
        partition: Partitioner | None = None,
        data_dir: str = "data",
        download: bool = False,
        image_size: int = 28,
        invert: bool = True,
        write_report: bool = True,
        clients_per_round: int | None = None,
        participation: float | None = 0.2,
        seed: int | None = None,
    ) -> None:
        partition = partition if partition is not None else Natural(test_fraction=0.2, stratify=True)
        super().__init__(
            num_clients, partition, None, 0, None, 0, None, write_report, clients_per_round, participation, seed
        )
        self.data_dir, self.download, self.image_size, self.invert = Path(data_dir), download, image_size, invert

    def load(self) -> Pools:
        root = self.data_dir / "omniglot-py"
        if self.download and not (root / "images_evaluation").exists():
            import torchvision

            for background in (True, False):
                fetch = lambda b=background: torchvision.datasets.Omniglot(str(self.data_dir), b, download=True)  # noqa: E731
                _download(fetch, "Omniglot", root)
        if not (root / "images_background").is_dir() or not (root / "images_evaluation").is_dir():
            raise _missing("Omniglot", root, "folders images_background/ and images_evaluation/ of alphabet folders")
        x, y, g, names = read_omniglot(root, self.image_size, self.invert)
        return Pools(x, y, x[:0], y[:0], int(y.max()) + 1, g, g[:0], names)

    def build(self) -> FederatedData:
        fed = super().build()
        fed.extras["alphabet"] = fed.extras["group"]
        return fed
