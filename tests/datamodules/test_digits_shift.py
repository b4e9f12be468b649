"""``datamodules/digits_shift.py``: PerFedSI's bundled stand-in: the digits upsampled (bilinear) to ``image_size``,
one of the four shift groups per client, and the one-hot shift group as side information."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from datamodules import DigitsShiftDataModule
from datamodules.feature_shift import PAPER_SHIFTS, affine_shift


def test_upsampled_shifted_digits_with_the_one_hot_group_as_side_information():
    dm = DigitsShiftDataModule(num_clients=8, image_size=16, seed=0)
    dm.setup("fit")
    fed, plain = dm.federated, dm.base.federated
    groups = fed.extras["shift_group"]
    assert fed.train.x.shape[1:] == (1, 16, 16) and torch.equal(fed.train.ptr, plain.train.ptr)
    assert torch.equal(fed.side, F.one_hot(groups, 4).float())
    assert sorted(torch.bincount(groups, minlength=4).tolist()) == [2, 2, 2, 2]
    for c in range(8):
        rotation, shear = PAPER_SHIFTS[int(groups[c])]
        x0, y0 = plain.train.client(c)
        big = F.interpolate(x0, size=(16, 16), mode="bilinear", align_corners=False)
        x, y = fed.train.client(c)
        torch.testing.assert_close(x, affine_shift(big, rotation, shear))
        assert torch.equal(y, y0)
