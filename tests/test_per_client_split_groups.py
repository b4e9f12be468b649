"""``PerClientSplit`` around a partition that uses natural owners, and around a plain partition callable:
the inner partition sees the merged pool and no test samples (so no owner gains a phantom test sample when
owners are counted), and a callable without ``uses_groups`` is treated as group-free (not handed groups)."""

from __future__ import annotations

import numpy as np
import torch

from datamodules.partition import Natural, PerClientSplit


def test_natural_inside_counts_owners_on_the_training_pool_only() -> None:
    """Owner 0 holds samples 0, 1 (fewer than ``min_samples`` = 3), owner 1 holds 2..5 (two of each class).
    Only owner 1 is eligible, so the two clients are owner 1 cut in two, class by class: no client holds a
    sample of owner 0, and every sample of owner 1 lands in exactly one client's train ∪ test."""
    groups = torch.tensor([0, 0, 1, 1, 1, 1])
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    train, test = PerClientSplit(Natural(min_samples=3), test_fraction=0.5)(
        labels, labels[:0], 2, np.random.default_rng(0), train_groups=groups
    )
    owned = [sorted(torch.cat([tr, te]).tolist()) for tr, te in zip(train, test)]
    assert sorted(i for client in owned for i in client) == [2, 3, 4, 5]
    assert [sorted(labels[c].tolist()) for c in owned] == [[0, 1], [0, 1]]  # class by class
    assert [len(t) for t in test] == [1, 1]  # round(0.5·2)


def test_a_callable_without_uses_groups_is_group_free() -> None:
    """A plain function as the inner partition: ``uses_groups`` is ``False`` (a bool) and the function is
    called without group arguments; its train sets are then cut as usual."""
    calls: list[dict] = []

    def halves(train_labels, test_labels, num_clients, rng, **kw):
        calls.append(kw)
        n = len(train_labels)
        return [torch.arange(0, n // 2), torch.arange(n // 2, n)], [torch.arange(0), torch.arange(0)]

    split = PerClientSplit(halves, test_fraction=0.5)
    assert split.uses_groups is False
    labels = torch.zeros(8, dtype=torch.long)
    train, test = split(labels, labels[:0], 2, np.random.default_rng(0), train_groups=torch.zeros(8, dtype=torch.long))
    assert calls == [{}]
    assert [sorted(torch.cat([a, b]).tolist()) for a, b in zip(train, test)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(t) for t in test] == [2, 2]
