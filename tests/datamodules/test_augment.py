"""Partitioners, partition hash and report, augmentation, and the Table 1 configs end to end."""

from __future__ import annotations

import torch

from datamodules.augment import CropFlip


# ---- augmentation ---------------------------------------------------------------------------------------
def test_crop_flip_matches_a_padded_crop():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    x = torch.randn(16, 3, 8, 8)
    aug = CropFlip(2, True, mean, std)
    out = aug(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, aug(x, torch.Generator().manual_seed(0)))
    fill = torch.tensor([-m / s for m, s in zip(mean, std)]).view(3, 1, 1)
    flips = 0
    for i in range(16):
        padded = fill.expand(3, 12, 12).clone()
        padded[:, 2:10, 2:10] = x[i]
        crops = [padded[:, r : r + 8, c : c + 8] for r in range(5) for c in range(5)]
        plain = any(torch.allclose(out[i], cr) for cr in crops)
        flipped = any(torch.allclose(out[i], cr.flip(-1)) for cr in crops)
        assert plain or flipped
        flips += flipped and not plain
    assert 0 < flips < 16
