"""Batched on-device image augmentation: ``FederatedData.augment(x, generator) -> x``.

The random draws come from the client's CPU ``torch.Generator`` (seeded by (seed, round, client)), so a
client's augmentations do not depend on the device or on which process runs it. An augmentation with
``draw(n, generator)`` and ``apply(x, draws)`` lets the executors draw a whole epoch at once and move it to the
device in one copy; a plain ``(x, generator) -> x`` callable also works (drawn batch by batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``(x - mean) / std`` per channel of an ``[N, C, H, W]`` batch."""
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


class CropFlip:
    """Random crop with ``padding`` pixels of zero padding plus a random horizontal flip (p = 0.5).

    This is torchvision's ``RandomCrop(size, padding)`` + ``RandomHorizontalFlip()`` used by FedRep's CIFAR
    runs (spec 000 §8.2), done for a whole batch at once. The data are already normalised, so the padding
    value is the normalised image of a black pixel, ``-mean/std``, as if padding happened before
    ``Normalize``.

    Args:
        padding: pixels added on every side before cropping back to the original size.
        flip: also flip horizontally with probability 0.5.
        mean, std: the normalisation applied at load time (to compute the padding value).
    """

    def __init__(
        self,
        padding: int = 4,
        flip: bool = True,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
    ) -> None:
        self.padding, self.flip = padding, flip
        self.fill = None if mean is None else [-m / s for m, s in zip(mean, std)]
        self._borders: dict[tuple, Tensor] = {}  # the padding's fill image per (device, dtype, shape): made once

    def border(self, x: Tensor) -> Tensor:
        """``fill`` on the padded border, 0 inside, shaped ``[1, C, H + 2p, W + 2p]`` (built once per device, so
        applying the augmentation never copies from the host)."""
        _, c, h, w = x.shape
        key = (x.device, x.dtype, c, h, w)
        if key not in self._borders:
            p = self.padding
            fill = torch.tensor(self.fill, dtype=x.dtype).view(1, c, 1, 1)
            inside = F.pad(torch.ones(1, 1, h, w, dtype=x.dtype), (p, p, p, p))
            self._borders[key] = ((1 - inside) * fill).to(x.device)
        return self._borders[key]

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return self.apply(x, self.draw(x.shape[0], generator).to(x.device))

    def draw(self, n: int, generator: torch.Generator) -> Tensor:
        """The random draws for ``n`` images, ``[n, 3]`` int64 on the CPU: row and column offset of the crop in
        the padded image, and 1 to flip. The executors draw a client's whole epoch at once and copy it to the
        device in one transfer; ``apply`` is per image, so any slice of the draws augments the matching images."""
        p = self.padding
        out = torch.zeros(n, 3, dtype=torch.long)
        if p > 0:
            out[:, :2] = torch.randint(0, 2 * p + 1, (n, 2), generator=generator)
        if self.flip:
            out[:, 2] = (torch.rand(n, generator=generator) < 0.5).long()
        return out

    def apply(self, x: Tensor, draws: Tensor) -> Tensor:
        """Crop and flip ``x`` ``[N, C, H, W]`` with ``draws`` ``[N, 3]`` (from ``draw``, on x's device)."""
        n, c, h, w = x.shape
        p = self.padding
        if p > 0:
            offsets = draws[:, :2]
            padded = F.pad(x, (p, p, p, p))
            if self.fill is not None:
                padded = padded + self.border(x)
            rows = (offsets[:, 0:1] + torch.arange(h, device=x.device)).view(n, 1, h, 1).expand(n, c, h, w + 2 * p)
            padded = padded.gather(2, rows)
            cols = (offsets[:, 1:2] + torch.arange(w, device=x.device)).view(n, 1, 1, w).expand(n, c, h, w)
            x = padded.gather(3, cols)
        if self.flip:
            x = torch.where(draws[:, 2].bool().view(n, 1, 1, 1), x.flip(-1), x)
        return x
