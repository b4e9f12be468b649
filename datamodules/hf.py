"""Hugging Face ``datasets`` path: a hub name or a local directory (``save_to_disk`` or parquet files).

``path`` is tried in this order:

1. a directory written by ``Dataset(Dict).save_to_disk`` (has ``dataset_dict.json`` or ``state.json``):
   ``datasets.load_from_disk``;
2. a directory of parquet files: ``load_dataset("parquet", data_files=...)`` with one split per file-name
   prefix or sub-folder (``train-00000-of-00001.parquet`` or ``train/*.parquet``);
3. otherwise a hub name for ``load_dataset(path, name)`` (needs the network or the local HF cache).

Numeric features are supported: images (decoded to ``[C, H, W]`` in [0, 1]) or fixed-length number
lists. ``group_column`` (e.g. a writer id) gives natural clients for ``Natural``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from datamodules.common import PartitionedDataModule, Pools
from fl_lightning.errors import ConfigError


def load_hf(path: str, name: str | None = None, cache_dir: str | None = None):
    """A ``DatasetDict`` from a local ``save_to_disk`` folder, a local parquet folder, or the hub."""
    import datasets

    p = Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
            try:
                ds = datasets.load_from_disk(str(p))
            except Exception as exc:
                raise ConfigError(f"{p}: cannot load saved dataset ({type(exc).__name__}: {exc})") from None
            return ds if isinstance(ds, datasets.DatasetDict) else datasets.DatasetDict({"train": ds})
        files = sorted(p.rglob("*.parquet"))
        if not files:
            raise ConfigError(f"{p}: no parquet files and no save_to_disk dataset")
        data_files: dict[str, list[str]] = {}
        for f in files:
            split = f.parent.name if f.parent != p and f.parent.name in ("train", "test", "validation") else None
            split = split or f.stem.split("-")[0].split("_")[0]
            data_files.setdefault(split, []).append(str(f))
        try:
            return datasets.load_dataset("parquet", data_files=data_files, cache_dir=cache_dir)
        except Exception as exc:
            raise ConfigError(f"{p}: cannot read parquet files ({type(exc).__name__}: {exc})") from None
    if p.exists() or path.startswith((".", "/")):
        raise ConfigError(f"HF dataset {path}: not a directory")
    try:
        return datasets.load_dataset(path, name, cache_dir=cache_dir)
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200]
        raise ConfigError(
            f"HF dataset {path!r} could not be loaded ({type(exc).__name__}: {msg}); "
            "give a local save_to_disk or parquet directory as data.init_args.path"
        ) from None


def _features(column, name: str, split: str) -> Tensor:
    first = column[0] if len(column) else None
    if hasattr(first, "convert"):  # PIL images
        arrays = [np.asarray(im) for im in column]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ConfigError(
                f"HF split {split!r}: column {name!r} has images of different shapes {sorted(shapes)[:3]}"
            )
        x = torch.from_numpy(np.stack(arrays)).float().div_(255)
        return x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2).contiguous()
    try:
        return torch.as_tensor(np.asarray(column, dtype=np.float32))
    except (ValueError, TypeError):
        raise ConfigError(
            f"HF split {split!r}: column {name!r} is not an image or a fixed-length number list"
        ) from None


class HFDataModule(PartitionedDataModule):
    """A classification dataset through HF ``datasets`` (see the module docstring for ``path``).

    Args:
        path: hub name or local directory.
        feature_column, label_column: the input and the integer class label.
        group_column: the natural owner (for ``Natural``), optional.
        train_split, test_split: split names; without a test split use a pooled partitioner
            (``PerClientSplit``, ``LogNormal``, or ``Natural(test_fraction=…)``).
        num_classes: default: the label feature's class count, else max label + 1.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        feature_column: str = "image",
        label_column: str = "label",
        group_column: str | None = None,
        train_split: str = "train",
        test_split: str | None = "test",
        num_classes: int | None = None,
        cache_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # num_clients, partition, …: PartitionedDataModule
        self.path, self.name, self.cache_dir = path, name, cache_dir
        self.feature_column, self.label_column, self.group_column = feature_column, label_column, group_column
        self.train_split, self.test_split, self.num_classes = train_split, test_split, num_classes

    def load(self) -> Pools:
        dsd = load_hf(self.path, self.name, self.cache_dir)
        if self.train_split not in dsd:
            raise ConfigError(f"HF dataset {self.path}: no split {self.train_split!r} (has {sorted(dsd)})")
        if self.test_split is not None and self.test_split not in dsd:
            raise ConfigError(
                f"HF dataset {self.path}: no split {self.test_split!r} (has {sorted(dsd)}); "
                "set test_split: null and use a pooled partition"
            )
        splits = [dsd[self.train_split]] + ([dsd[self.test_split]] if self.test_split else [])
        label_feature = splits[0].features.get(self.label_column)
        num_classes = self.num_classes or getattr(label_feature, "num_classes", None)
        out, group_ids = [], {}
        for ds, split in zip(splits, (self.train_split, self.test_split)):
            cols = [self.feature_column, self.label_column] + ([self.group_column] if self.group_column else [])
            missing = [c for c in cols if c not in ds.column_names]
            if missing:
                raise ConfigError(f"HF split {split!r}: no column {missing[0]!r} (has {ds.column_names})")
            x = _features(ds[self.feature_column], self.feature_column, split)
            try:
                y = torch.as_tensor(np.asarray(ds[self.label_column], dtype=np.int64))
            except (ValueError, TypeError):
                raise ConfigError(f"HF split {split!r}: label column {self.label_column!r} is not integer") from None
            g = None
            if self.group_column:
                g = torch.tensor([group_ids.setdefault(v, len(group_ids)) for v in ds[self.group_column]])
            out.append((x, y, g))
        if num_classes is None:
            num_classes = int(max(int(y.max()) for _, y, _ in out if y.numel())) + 1
        for (_, y, _), split in zip(out, (self.train_split, self.test_split)):
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
                bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
                raise ConfigError(f"HF split {split!r}: label {bad} out of range 0..{num_classes - 1}")
        x_tr, y_tr, g_tr = out[0]
        x_te, y_te, g_te = out[1] if len(out) > 1 else (x_tr[:0], y_tr[:0], None if g_tr is None else g_tr[:0])
        if len(out) == 1 and not self.partition.pooled:
            raise ConfigError(f"HF dataset {self.path}: no test split; use a pooled partition (e.g. PerClientSplit)")
        names = [str(k) for k in group_ids] if group_ids else None
        return Pools(x_tr, y_tr, x_te, y_te, num_classes, g_tr, g_te, names)
