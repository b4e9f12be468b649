"""Dataset loaders on files written in their real on-disk formats, through the public DataModules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules import HFDataModule, Natural, PerClientSplit, Shards
from tests.helpers.data_fixtures import write_hf
from tests.helpers.loaders import built, row_keys


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
