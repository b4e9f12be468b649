"""PerFedSI's covariate shift (spec 002 §4.3): an i.i.d. partition, then one of four affine shifts per client.

Groups (paper l. 631–634, in its order; the group index is the side-information one-hot position):

    0: rotate 90° clockwise, then shear 3° clockwise
    1: rotate 180° clockwise, then shear 6° clockwise
    2: rotate 270° clockwise, then shear 9° clockwise
    3: no shift

Conventions (the paper gives none; spec 002 §4.3 [UNCLEAR]): rotations are exact ``torch.rot90`` turns.
A clockwise shear by φ tilts the image's vertical axis φ clockwise: a pixel ``y`` rows below the centre moves
``−tan φ · y`` columns, so the top of a vertical stroke leans right. It is torchvision's ``affine`` with
``shear=[φ, 0]`` (bilinear, zero fill); the spec suggested ``[−φ, 0]`` assuming torchvision's shear is
counter-clockwise-positive like its rotation, but for shear it is not (``tests/datamodules/test_feature_shift.py``
checks the definition on a known image). A client's train and test images get its shift once, when the data are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from datamodules.partition import IndexSets, Partitioner, _as_tensors
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError

PAPER_SHIFTS: tuple[tuple[float, float], ...] = ((90.0, 3.0), (180.0, 6.0), (270.0, 9.0), (0.0, 0.0))


def affine_shift(x: Tensor, rotation: float, shear: float) -> Tensor:
    """Rotate a batch ``[..., H, W]`` by ``rotation``° clockwise (a multiple of 90), then shear ``shear``° clockwise."""
    if rotation % 90:
        raise ConfigError(f"feature shift rotations must be multiples of 90°, got {rotation}")
    out = torch.rot90(x, -int(rotation // 90) % 4, dims=(-2, -1))
    if shear:
        from torchvision.transforms import InterpolationMode
        from torchvision.transforms.v2 import functional as TF

        out = TF.affine(
            out, angle=0.0, translate=[0, 0], scale=1.0, shear=[float(shear), 0.0],
            interpolation=InterpolationMode.BILINEAR, fill=0.0,
        )  # fmt: skip
    return out.contiguous()


class IIDSplit(Partitioner):
    """Uniform i.i.d. split: train and test pools shuffled and cut into ``num_clients`` near-equal parts."""

    def __call__(self, train_labels, test_labels, num_clients, rng):
        parts = []
        for labels in (train_labels, test_labels):
            parts.append(_as_tensors(np.array_split(rng.permutation(len(labels)), num_clients)))
        return parts[0], parts[1]


class FeatureShift(Partitioner):
    """Partition with ``base`` (default i.i.d.), then give every client one affine shift group.

    Args:
        base: the label partition (``IIDSplit`` when None, as in the paper).
        shifts: ``(rotation°, shear°)`` per group, clockwise; the default is the paper's four groups.
        assignment: ``balanced`` = a random permutation of ``0,1,2,3,0,1,…`` (equal group sizes ±1);
            ``random`` = each client's group drawn uniformly.
    """

    def __init__(
        self,
        base: Partitioner | None = None,
        shifts: Sequence[tuple[float, float]] = PAPER_SHIFTS,
        assignment: Literal["balanced", "random"] = "balanced",
    ) -> None:
        if assignment not in ("balanced", "random"):
            raise ConfigError(f"FeatureShift.assignment must be 'balanced' or 'random', got {assignment!r}")
        if not shifts:
            raise ConfigError("FeatureShift.shifts is empty")
        self.base = base if base is not None else IIDSplit()
        self.shifts = [(float(r), float(s)) for r, s in shifts]
        self.assignment = assignment

    @property
    def num_groups(self) -> int:
        return len(self.shifts)

    def __call__(
        self, train_labels: Tensor, test_labels: Tensor, num_clients: int, rng: np.random.Generator
    ) -> tuple[IndexSets, IndexSets]:
        return self.base(train_labels, test_labels, num_clients, rng)

    def assign_groups(self, num_clients: int, rng: np.random.Generator) -> Tensor:
        """The shift group of every client: ``[num_clients]`` long."""
        g = self.num_groups
        if self.assignment == "balanced":
            groups = rng.permutation(np.arange(num_clients) % g)
        else:
            groups = rng.integers(0, g, size=num_clients)
        return torch.as_tensor(groups, dtype=torch.long)

    def transform(self, x: Tensor, group: int) -> Tensor:
        rotation, shear = self.shifts[group]
        return affine_shift(x, rotation, shear)

    def apply(self, fed: FederatedData, groups: Tensor) -> FederatedData:
        """Every client's rows (train, test, val) transformed by its group; ``extras["shift_group"] = groups``."""
        if groups.shape != (fed.num_clients,):
            raise ConfigError(f"FeatureShift: {groups.shape[0]} groups for {fed.num_clients} clients")
        if fed.train.x.dim() < 3:
            raise ConfigError(f"FeatureShift needs image tensors [N, C, H, W], got shape {tuple(fed.train.x.shape)}")

        def shifted(split: ClientSplit) -> ClientSplit:
            row_group = torch.repeat_interleave(groups.to(split.ptr.device), split.sizes)
            x = split.x.clone()
            for g in range(self.num_groups):
                rows = torch.nonzero(row_group == g).flatten()
                if rows.numel():
                    x[rows] = self.transform(split.x[rows], g)
            return ClientSplit(x, split.y, split.ptr)

        return replace(fed.map_splits(shifted), extras={**fed.extras, "shift_group": groups})
