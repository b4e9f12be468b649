"""``FederatedDataModule.partition_hash`` against a hashlib/numpy reference written here: SHA-256 over, per split
(train, test, then val when there is one), the ``ptr`` bytes, the label bytes and every row's feature sum (float32,
rounded to 4 decimals); the hash is the first 16 hex digits."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import torch

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData


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
