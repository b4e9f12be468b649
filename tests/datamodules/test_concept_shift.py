"""``datamodules/concept_shift.py``: the leaderboard's benchmark data: each group's label permutation (group 0 keeps its
labels), balanced groups, images as they are without rotation, a rotated group, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch

from datamodules.concept_shift import GroupShift
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError


def test_group_shift_permutes_each_groups_labels_and_keeps_group_zero():
    from datamodules import DigitsGroupShiftDataModule, Dirichlet

    dm = DigitsGroupShiftDataModule(num_clients=12, partition=Dirichlet(1.0, min_samples=5), seed=3)
    dm.setup("fit")
    fed, plain = dm.federated, dm.base.federated
    groups, perms = fed.extras["shift_group"], fed.extras["label_permutations"]
    assert perms.shape == (4, 10) and torch.equal(perms[0], torch.arange(10))
    assert all(sorted(p.tolist()) == list(range(10)) for p in perms) and len({tuple(p.tolist()) for p in perms}) == 4
    assert sorted(torch.bincount(groups, minlength=4).tolist()) == [3, 3, 3, 3]
    for split, before in ((fed.train, plain.train), (fed.test, plain.test)):
        assert torch.equal(split.x, before.x) and torch.equal(split.ptr, before.ptr)  # no rotation: images as they are
        for c in range(12):
            _, y = split.client(c)
            _, y0 = before.client(c)
            assert torch.equal(y, perms[groups[c]][y0])


def test_a_rotated_group_turns_its_images_and_relabels_without_permutation_when_asked():
    """Two groups, the second rotated 180°: its rows are the images turned twice by 90° (``torch.rot90``, clockwise or
    not alike at 180°); ``permute_labels=False`` keeps every label."""
    x = torch.arange(4 * 9, dtype=torch.float32).view(4, 1, 3, 3)
    y = torch.tensor([0, 1, 2, 1])
    split = ClientSplit(x, y, torch.tensor([0, 2, 4]))
    fed = FederatedData(split, split, num_classes=3)
    shift = GroupShift(rotations=(0.0, 180.0), num_classes=3, permute_labels=False)
    out = shift.apply(fed, torch.tensor([0, 1]))
    assert torch.equal(out.train.x[:2], x[:2]) and torch.equal(out.train.y, y)
    assert torch.equal(out.train.x[2:], torch.rot90(x[2:], 2, dims=(2, 3)))
    assert torch.equal(out.extras["label_permutations"], torch.arange(3).repeat(2, 1))
    with pytest.raises(ConfigError, match="label 2 ≥ num_classes=2"):
        GroupShift(rotations=(0.0, 0.0), num_classes=2).apply(fed, torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match="num_classes must be ≥ 2, got 1"):
        GroupShift(num_classes=1)
