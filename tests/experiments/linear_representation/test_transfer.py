"""``experiments/linear_representation/transfer.py`` (spec 004 §4.2): the class-balanced subset a new client keeps
for fine-tuning."""

from __future__ import annotations

import torch

from experiments.linear_representation.transfer import balanced_subset
from tests.helpers.linear_tasks import gen


def test_balanced_subset_takes_distinct_indices_two_or_three_per_class():
    labels = torch.arange(20).repeat_interleave(5)
    idx = balanced_subset(labels, 50, gen(20))
    counts = torch.bincount(labels[idx], minlength=20)
    assert len(set(idx.tolist())) == 50 and set(counts.tolist()) == {2, 3}
    assert sorted(balanced_subset(labels, 1000, gen(0)).tolist()) == list(range(100))  # at most every sample
