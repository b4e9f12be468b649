"""Image datasets read with ``torchvision.datasets`` from their published on-disk formats, once, into tensors.

``download: true`` lets torchvision fetch the files when some are missing (online); otherwise they must already
be in ``data_dir`` in torchvision's layout. Problems become one-line ``ConfigError``s naming the folder or file.

Layouts under ``data_dir`` (torchvision's):

- CIFAR-10: ``cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``
  (``torchvision.datasets.CIFAR10``, which checks every file's md5 against the published archive);
- CIFAR-100: ``cifar-100-python/{train, test, meta}`` (``CIFAR100``, md5-checked as well);
- MNIST: ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (``MNIST``; a ``.gz`` alone is
  decompressed next to itself first, as torchvision's download does; ``MNIST/processed/`` also works);
- EMNIST: ``EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` (``EMNIST``);
- Omniglot: ``omniglot-py/images_{background,evaluation}/<alphabet>/<character>/*.png``, read with
  ``torchvision.datasets.DatasetFolder`` (sorted paths; ``Omniglot`` itself is used to download: its reader
  needs the zip archives next to the folders and lists them in file-system order, which differs between
  machines and would change the class ids).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from datamodules.augment import CropFlip, normalize
from datamodules.common import PartitionedDataModule, Pools
from datamodules.partition import Natural, Partitioner
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError

# FedRep's normalisation constants (spec 000 §8.2).
CIFAR10_MEAN, CIFAR10_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR100_MEAN, CIFAR100_STD = (0.507, 0.487, 0.441), (0.267, 0.256, 0.276)


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _missing(name: str, expected: Path, hint: str) -> ConfigError:
    return ConfigError(
        f"{name} not found: expected {expected} ({hint}); put the files there or set data.init_args.download: true"
    )


def _download(fetch: Callable[[], object], name: str, expected: Path) -> None:
    try:
        fetch()
    except Exception as exc:  # network errors come in many types
        raise ConfigError(f"{name}: download failed ({_short(exc)}); put the files at {expected}") from None


def _check_labels(y: np.ndarray, num_classes: int, path: Path, lo: int = 0) -> None:
    if y.size and (y.min() < lo or y.max() >= num_classes + lo):
        bad = int(y.min()) if y.min() < lo else int(y.max())
        raise ConfigError(f"{path}: label {bad} out of range {lo}..{num_classes + lo - 1}")


# ---- CIFAR ----------------------------------------------------------------------------------------------
def read_cifar(tv_class: str, data_dir: Path, name: str, download: bool) -> tuple[np.ndarray, ...]:
    """``torchvision.datasets.CIFAR10``/``CIFAR100`` train and test sets as uint8 ``[N, 3, 32, 32]`` images
    and int64 labels: ``(x_train, y_train, x_test, y_test)``."""
    from torchvision import datasets
    from torchvision.datasets import cifar

    tv = getattr(datasets, tv_class)
    folder = data_dir / tv.base_folder
    listed = [*tv.train_list, *tv.test_list, [tv.meta["filename"], tv.meta["md5"]]]
    missing = [f for f, _ in listed if not (folder / f).is_file()]
    if missing and download:
        _download(lambda: tv(str(data_dir), train=True, download=True), name, folder)
        missing = [f for f, _ in listed if not (folder / f).is_file()]
    if missing:
        files = ", ".join(f for f, _ in listed)
        raise _missing(name, folder, f"the python-version files {files}; first missing: {missing[0]}")
    out = []
    for train in (True, False):
        try:
            ds = tv(str(data_dir), train=train)
        except RuntimeError as exc:
            bad = [f for f, md5 in listed if not cifar.check_integrity(str(folder / f), md5)]
            if not bad:
                raise ConfigError(f"{name}: torchvision could not read {folder} ({_short(exc)})") from None
            raise ConfigError(
                f"{folder / bad[0]}: md5 differs from the published {tv.filename} (truncated or modified file); "
                f"extract the archive again, or delete {folder} and set data.init_args.download: true"
            ) from None
        except Exception as exc:  # a damaged pickle when the md5 check is bypassed
            raise ConfigError(f"{name}: torchvision could not read {folder} ({_short(exc)})") from None
        x = np.ascontiguousarray(np.asarray(ds.data, dtype=np.uint8).transpose(0, 3, 1, 2))  # HWC -> CHW
        y = np.asarray(ds.targets, dtype=np.int64)
        _check_labels(y, len(ds.classes), folder)
        out += [x, y]
    return tuple(out)


class _CifarBase(PartitionedDataModule):
    name, tv_class, num_classes, mean, std = "", "", 0, (), ()

    def __init__(self, data_dir: str = "data", download: bool = False, augment: bool = True, **kwargs: Any) -> None:
        """``data_dir``: torchvision's root folder; ``augment``: crop and flip on the training device; the other
        arguments (``num_clients``, ``partition``, …) as :class:`PartitionedDataModule`."""
        super().__init__(**kwargs)
        self.data_dir, self.download, self.augment = Path(data_dir), download, augment

    def load(self) -> Pools:
        x_tr, y_tr, x_te, y_te = read_cifar(self.tv_class, self.data_dir, self.name, self.download)

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

    name, tv_class, num_classes, mean, std = "CIFAR-10", "CIFAR10", 10, CIFAR10_MEAN, CIFAR10_STD


class CIFAR100DataModule(_CifarBase):
    """CIFAR-100 (fine labels, 100 classes), normalised with FedRep's CIFAR-100 constants; otherwise as
    :class:`CIFAR10DataModule`. Spec 004's transfer split: ``transfer_classes: [80, …, 99]``."""

    name, tv_class, num_classes, mean, std = "CIFAR-100", "CIFAR100", 100, CIFAR100_MEAN, CIFAR100_STD


# ---- MNIST / EMNIST (IDX) ------------------------------------------------------------------------------
def _decompress_lone_gz(files: list[Path]) -> None:
    """``X.gz`` without ``X``: decompress it next to itself (what torchvision's download does after fetching)."""
    from torchvision.datasets.utils import extract_archive

    for f in files:
        gz = f.with_name(f.name + ".gz")
        if not f.exists() and gz.exists():
            try:
                extract_archive(str(gz))
            except Exception as exc:
                raise ConfigError(f"{gz}: cannot decompress ({_short(exc)})") from None


def read_idx_pair(dataset: Any, images: Path, labels: Path, num_classes: int, offset: int) -> tuple[Tensor, Tensor]:
    """A torchvision MNIST-family dataset's ``data``/``targets`` checked: images ``[N, 1, 28, 28]`` in [0, 1]
    and labels ``[N]`` shifted to start at 0."""
    x, y = dataset.data, dataset.targets.long()
    if x.dim() != 3 or tuple(x.shape[1:]) != (28, 28):
        raise ConfigError(f"{images}: images have shape {list(x.shape)}, expected [N, 28, 28]")
    if y.dim() != 1 or len(y) != len(x):
        raise ConfigError(f"{labels}: labels have shape {list(y.shape)}, expected [{len(x)}]")
    _check_labels(y.numpy(), num_classes, labels, offset)
    return x.float().div(255).unsqueeze(1), y - offset


def open_idx(make: Callable[[], Any], name: str, files: list[Path]) -> Any:
    """Build a torchvision MNIST-family dataset; a file it cannot parse is named in a one-line error."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    try:
        return make()
    except Exception as exc:
        for f in files:  # find the culprit with torchvision's own readers
            try:
                (read_image_file if "images" in f.name else read_label_file)(str(f))
            except Exception as inner:
                raise ConfigError(f"{f}: not a readable IDX file, truncated or damaged ({_short(inner)})") from None
        raise ConfigError(f"{name}: torchvision could not read {files[0].parent} ({_short(exc)})") from None


class _IdxBase(PartitionedDataModule):
    name, tv_class = "", ""

    def idx_files(self, train: bool) -> tuple[Path, Path]:
        raise NotImplementedError

    def processed_files(self) -> tuple[Path, Path]:
        raise NotImplementedError

    def make_dataset(self, train: bool, download: bool = False) -> Any:
        raise NotImplementedError

    def read_split(self, train: bool, num_classes: int, offset: int = 0) -> tuple[Tensor, Tensor]:
        images, labels = self.idx_files(train)
        if not all(f.is_file() for f in self.processed_files()):  # torchvision's legacy processed/*.pt: as is
            files = [*self.idx_files(True), *self.idx_files(False)]  # torchvision wants both splits present
            _decompress_lone_gz(files)
            if self.download and not all(f.exists() for f in files):
                _download(lambda: self.make_dataset(train, download=True), self.name, images.parent)
            missing = [f.name for f in files if not f.exists()]
            if missing:
                names = ", ".join(f.name for f in files)
                raise _missing(self.name, images.parent, f"IDX files {names}; first missing: {missing[0]}")
        ds = open_idx(lambda: self.make_dataset(train), self.name, [images, labels])
        return read_idx_pair(ds, images, labels, num_classes, offset)


class MNISTDataModule(_IdxBase):
    """MNIST (60,000 train / 10,000 test, 28×28), pixels in [0, 1], shape ``[N, 1, 28, 28]``."""

    name = "MNIST"

    def __init__(self, data_dir: str = "data", download: bool = False, **kwargs: Any) -> None:
        """``data_dir``: torchvision's root folder; the other arguments as :class:`PartitionedDataModule`."""
        super().__init__(**kwargs)
        self.data_dir, self.download = Path(data_dir), download

    def idx_files(self, train: bool) -> tuple[Path, Path]:
        raw, prefix = self.data_dir / "MNIST" / "raw", "train" if train else "t10k"
        return raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"

    def processed_files(self) -> tuple[Path, Path]:
        processed = self.data_dir / "MNIST" / "processed"
        return processed / "training.pt", processed / "test.pt"

    def make_dataset(self, train: bool, download: bool = False) -> Any:
        from torchvision.datasets import MNIST

        return MNIST(str(self.data_dir), train=train, download=download)

    def load(self) -> Pools:
        x_tr, y_tr = self.read_split(True, 10)
        x_te, y_te = self.read_split(False, 10)
        return Pools(x_tr, y_tr, x_te, y_te, 10)


class EMNISTDataModule(_IdxBase):
    """EMNIST ``letters`` (26 classes; the files' labels 1–26 become 0–25) or ``digits`` (10 classes).

    The IDX images of EMNIST are stored transposed; they are turned upright here. Pixels in [0, 1].
    """

    name = "EMNIST"

    def __init__(
        self, split: Literal["letters", "digits"] = "letters", data_dir: str = "data", download: bool = False,
        **kwargs: Any,
    ) -> None:  # fmt: skip
        """``split``: ``letters`` or ``digits``; the other arguments as :class:`MNISTDataModule`."""
        super().__init__(**kwargs)
        if split not in ("letters", "digits"):
            raise ConfigError(f"EMNISTDataModule.split must be 'letters' or 'digits', got {split!r}")
        self.split, self.data_dir, self.download = split, Path(data_dir), download

    def idx_files(self, train: bool) -> tuple[Path, Path]:
        raw, prefix = self.data_dir / "EMNIST" / "raw", f"emnist-{self.split}-{'train' if train else 'test'}"
        return raw / f"{prefix}-images-idx3-ubyte", raw / f"{prefix}-labels-idx1-ubyte"

    def processed_files(self) -> tuple[Path, Path]:
        processed = self.data_dir / "EMNIST" / "processed"
        return processed / f"training_{self.split}.pt", processed / f"test_{self.split}.pt"

    def make_dataset(self, train: bool, download: bool = False) -> Any:
        from torchvision.datasets import EMNIST

        return EMNIST(str(self.data_dir), self.split, train=train, download=download)

    def load(self) -> Pools:
        num_classes, offset = (26, 1) if self.split == "letters" else (10, 0)
        x_tr, y_tr = self.read_split(True, num_classes, offset)
        x_te, y_te = self.read_split(False, num_classes, offset)
        return Pools(x_tr.transpose(-1, -2).contiguous(), y_tr, x_te.transpose(-1, -2).contiguous(), y_te, num_classes)


# ---- Omniglot (PNG folders) ----------------------------------------------------------------------------
def _grey_png(path: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("L"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"{path}: cannot read image ({_short(exc)})") from None


def read_omniglot(root: Path, image_size: int, invert: bool) -> tuple[Tensor, Tensor, Tensor, list[str]]:
    """All drawings of both sets: images ``[N, 1, s, s]`` in [0, 1], character ids, alphabet ids, alphabet
    names ("background/Latin"). Every set is one ``torchvision.datasets.DatasetFolder`` whose classes are the
    alphabets; characters are the drawings' parent folders. Alphabets, characters and drawings are numbered
    in sorted path order, background set first."""
    from torchvision.datasets import DatasetFolder

    images, chars, alphas, names = [], [], [], []
    for part in ("images_background", "images_evaluation"):
        try:
            ds = DatasetFolder(str(root / part), loader=_grey_png, extensions=(".png",))
        except (FileNotFoundError, OSError) as exc:
            raise ConfigError(f"{root / part}: {' '.join(str(exc).split())}") from None
        by_character: dict[tuple[int, str], list[int]] = {}  # (alphabet, character folder) -> sample indices
        for i, (path, alphabet) in enumerate(ds.samples):
            by_character.setdefault((alphabet, str(Path(path).parent)), []).append(i)
        for (alphabet, _), rows in by_character.items():  # insertion order = sorted path order
            batch = [ds[i][0] for i in rows]
            shapes = {b.shape for b in batch}
            if len(shapes) > 1:
                folder = Path(ds.samples[rows[0]][0]).parent
                raise ConfigError(f"{folder}: drawings have different sizes {sorted(shapes)}")
            x = torch.from_numpy(np.stack(batch)).float().div_(255).unsqueeze(1)
            if x.shape[-2:] != (image_size, image_size):
                x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True)
            images.append(1 - x if invert else x)
            chars += [len(images) - 1] * len(rows)
            alphas += [len(names) + alphabet] * len(rows)
        names += [f"{part.removeprefix('images_')}/{a}" for a in ds.classes]
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
        val_fraction: float = 0.0,
    ) -> None:
        partition = partition if partition is not None else Natural(test_fraction=0.2, stratify=True)
        super().__init__(
            num_clients, partition, None, 0, None, 0, None, write_report, clients_per_round, participation, seed,
            val_fraction=val_fraction,
        )  # fmt: skip
        self.data_dir, self.download, self.image_size, self.invert = Path(data_dir), download, image_size, invert

    def load(self) -> Pools:
        root = self.data_dir / "omniglot-py"
        if self.download and not ((root / "images_background").is_dir() and (root / "images_evaluation").is_dir()):
            from torchvision.datasets import Omniglot

            for background in (True, False):
                fetch = lambda b=background: Omniglot(str(self.data_dir), b, download=True)  # noqa: E731
                _download(fetch, "Omniglot", root)
        if not (root / "images_background").is_dir() or not (root / "images_evaluation").is_dir():
            raise _missing("Omniglot", root, "folders images_background/ and images_evaluation/ of alphabet folders")
        x, y, g, names = read_omniglot(root, self.image_size, self.invert)
        return Pools(x, y, x[:0], y[:0], int(y.max()) + 1, g, g[:0], names)

    def build(self) -> FederatedData:
        fed = super().build()
        fed.extras["alphabet"] = fed.extras["group"]
        return fed
