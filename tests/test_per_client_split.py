"""``PerClientSplit`` details the promise tests do not pin: its defaults (20 % test, not stratified), the accepted
range of ``test_fraction`` and what stratification changes, counted by hand on one client of two classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.partition import Dirichlet, PerClientSplit, Shards
from fl_lightning.errors import ConfigError


class OneClient(Shards):
    """Every sample to one client (the inner partition of these tests)."""

    def __call__(self, train_labels, test_labels, num_clients, rng):
        return [torch.arange(len(train_labels))], [torch.arange(len(test_labels))]


LABELS = torch.tensor([0] * 5 + [1] * 5)  # one client: 5 samples of each class


def split(**kwargs):
    train, test = PerClientSplit(OneClient(), **kwargs)(LABELS, LABELS[:0], 1, np.random.default_rng(0))
    return train[0].numpy(), test[0].numpy()


def test_default_is_a_twenty_percent_unstratified_cut():
    train, test = split()
    assert len(test) == 2 and len(train) == 8  # round(0.2 · 10)
    assert sorted(np.concatenate([train, test])) == list(range(10))


def test_stratify_cuts_every_class_and_plain_cut_does_not():
    # round(0.1 · 10) = 1 test sample in all; per class round(0.1 · 5) = 0, raised to 1 so each side keeps a sample
    train, test = split(test_fraction=0.1, stratify=False)
    assert len(test) == 1
    train, test = split(test_fraction=0.1)  # not stratified unless asked
    assert len(test) == 1
    train, test = split(test_fraction=0.1, stratify=True)
    assert len(test) == 2 and sorted(LABELS[test].tolist()) == [0, 1]


def test_test_fraction_zero_is_allowed_and_one_is_not():
    train, test = split(test_fraction=0.0)
    assert len(test) == 0 and len(train) == 10
    for bad in (1.0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"PerClientSplit.test_fraction must be in \[0, 1\)"):
            PerClientSplit(OneClient(), test_fraction=bad)


def test_takes_uses_groups_from_its_inner_partition():
    assert PerClientSplit(Dirichlet()).uses_groups is False
    natural = type("Grouped", (OneClient,), {"uses_groups": True})()
    assert PerClientSplit(natural).uses_groups is True


def test_natural_inside_sees_only_the_training_pool_when_counting_owner_sizes():
    from datamodules.partition import Natural

    # owner 0 has 2 samples, owners 1 and 2 have 3: with min_samples = 3 only owners 1 and 2 are clients (id order)
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    labels = torch.zeros(8, dtype=torch.long)
    split_natural = PerClientSplit(Natural(min_samples=3), test_fraction=0.0)
    train, test = split_natural(labels, labels[:0], 2, np.random.default_rng(0), train_groups=groups)
    assert [t.tolist() for t in train] == [[2, 3, 4], [5, 6, 7]]
    assert all(len(t) == 0 for t in test)
