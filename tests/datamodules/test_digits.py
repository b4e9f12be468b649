"""The bundled digits data as the framework defines it, against numpy and scikit-learn directly: pixels scaled
from 0–16 to [0, 1] in a ``[N, 1, 8, 8]`` float tensor, int64 labels; ``DigitsDataModule``'s defaults (20 clients,
2-class shards, a fifth of them per round, the given seed); its test pool drawn per class with the numpy stream
``[seed, 0]``; and FedRep's default local epochs (spec 000: 10 head epochs, then 1 body epoch)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits

from datamodules.digits import DigitsDataModule, load_digits_tensors
from datamodules.partition import Shards
from fl_lightning.algorithms.fedrep import FedRep


def test_digits_tensors_are_the_bundled_images_scaled_to_the_unit_interval() -> None:
    bunch = load_digits()
    x, y = load_digits_tensors()
    assert x.dtype == torch.float32 and x.shape == (len(bunch.target), 1, 8, 8)
    np.testing.assert_array_equal(x.numpy(), (bunch.images[:, None] / 16.0).astype(np.float32))
    assert float(x.max()) == 1.0 and float(x.min()) == 0.0
    assert y.dtype == torch.int64
    np.testing.assert_array_equal(y.numpy(), bunch.target)


def test_digits_module_defaults() -> None:
    dm = DigitsDataModule(seed=7)
    assert dm.num_clients == 20 and dm.clients_per_round == 4  # participation 0.2 of 20 clients
    assert isinstance(dm.partition, Shards) and dm.partition.classes_per_client == 2
    assert dm.resolved_seed == 7
    assert DigitsDataModule(participation=0.5, seed=7).clients_per_round == 10


class OneClientPartition:
    """Gives the whole train and test pool to one client, so the module's pools can be read back whole."""

    uses_groups = False

    def __call__(self, train_labels, test_labels, num_clients, rng, **kw):
        return [torch.arange(len(train_labels))], [torch.arange(len(test_labels))]


def test_the_test_pool_is_drawn_per_class_from_the_seeds_stream_zero() -> None:
    seed, fraction = 11, 0.25
    bunch = load_digits()
    rng = np.random.default_rng([seed, 0])
    test_rows = []
    for c in np.unique(bunch.target):  # the reference draw: each class's rows permuted, the first quarter held out
        rows = rng.permutation(np.flatnonzero(bunch.target == c))
        test_rows.append(rows[: int(round(fraction * len(rows)))])
    test_rows = np.sort(np.concatenate(test_rows))
    train_rows = np.setdiff1d(np.arange(len(bunch.target)), test_rows)

    dm = DigitsDataModule(num_clients=1, partition=OneClientPartition(), test_fraction=fraction, seed=seed)
    dm.setup()
    expected = (bunch.images[:, None] / 16.0).astype(np.float32)
    np.testing.assert_array_equal(dm.federated.test.x.numpy(), expected[test_rows])
    np.testing.assert_array_equal(dm.federated.train.x.numpy(), expected[train_rows])


def test_fedrep_default_local_epochs_are_ten_head_then_one_body() -> None:
    algorithm = FedRep()
    assert (algorithm.head_epochs, algorithm.body_epochs) == (10, 1)


def test_digits_tensors_are_read_once_and_each_caller_gets_its_own_copy(monkeypatch) -> None:
    """scikit-learn's file is parsed once per process; a caller that changes its tensors changes nobody else's."""
    import sklearn.datasets

    import datamodules.digits as digits_module

    reads = []
    monkeypatch.setattr(digits_module, "_DIGITS", None)
    real = sklearn.datasets.load_digits
    monkeypatch.setattr(sklearn.datasets, "load_digits", lambda *a, **k: reads.append(1) or real(*a, **k))
    x, y = load_digits_tensors()
    x.zero_()
    y.fill_(-1)
    x2, y2 = load_digits_tensors()
    assert len(reads) == 1
    bunch = real()
    np.testing.assert_array_equal(x2.numpy(), (bunch.images[:, None] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y2.numpy(), bunch.target)
