"""Concept shift on top of feature shift (issue 44's benchmark): clients fall in groups; every group rotates its
images by its own multiple of 90° (feature skew, "same label, different features") and relabels its classes by its
own fixed permutation (concept shift, "same features, different label"), the two non-i.i.d. kinds beside label and
quantity skew in Kairouz et al., "Advances and Open Problems in Federated Learning" (2021), §3.1.1. Group 0 keeps
the images and labels as they are. A client's train, validation and test rows get its group's shift, so every
client's task is consistent; a single global model cannot fit groups whose labels disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from datamodules.digits import DigitsDataModule
from datamodules.feature_shift import FeatureShift
from datamodules.partition import Dirichlet, Partitioner
from datamodules.side_info import SideInfoDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError


class GroupShift(FeatureShift):
    """``FeatureShift`` (rotations, no shear) whose groups also permute the labels.

    Args:
        base: the label partition (default i.i.d.).
        rotations: clockwise rotation of each group in degrees (multiples of 90); its length is the group count.
        num_classes: the classes permuted.
        permute_labels: each group but the first relabels class j as ``perm_g[j]``, a permutation drawn once from
            ``label_seed`` (the same for every run seed, so the task does not change with the seed).
        label_seed: the seed of the permutations.
    """

    def __init__(
        self,
        base: Partitioner | None = None,
        rotations: Sequence[float] = (0.0, 90.0, 180.0, 270.0),
        num_classes: int = 10,
        permute_labels: bool = True,
        label_seed: int = 0,
    ) -> None:
        super().__init__(base, [(float(r), 0.0) for r in rotations], "balanced")
        if num_classes < 2:
            raise ConfigError(f"GroupShift.num_classes must be ≥ 2, got {num_classes}")
        self.num_classes, self.permute_labels = num_classes, permute_labels
        rng = np.random.default_rng(label_seed)
        perms = [np.arange(num_classes)] + [rng.permutation(num_classes) for _ in range(len(self.shifts) - 1)]
        self.permutations = torch.as_tensor(np.stack(perms), dtype=torch.long)  # [groups, classes]
        if not permute_labels:
            self.permutations = torch.arange(num_classes).repeat(len(self.shifts), 1)

    def apply(self, fed: FederatedData, groups: torch.Tensor) -> FederatedData:
        """Rotate every client's rows by its group (``FeatureShift.apply``), then relabel them by its permutation."""
        fed = super().apply(fed, groups)

        def relabel(split: ClientSplit) -> ClientSplit:
            if split.y.numel() and int(split.y.max()) >= self.num_classes:
                raise ConfigError(f"GroupShift: label {int(split.y.max())} ≥ num_classes={self.num_classes}")
            row_group = torch.repeat_interleave(groups.to(split.ptr.device), split.sizes)
            return ClientSplit(split.x, self.permutations.to(split.y.device)[row_group, split.y], split.ptr)

        return replace(fed.map_splits(relabel), extras={**fed.extras, "label_permutations": self.permutations})


class DigitsGroupShiftDataModule(SideInfoDataModule):
    """scikit-learn digits partitioned by ``partition`` (default Dirichlet α = 1 label skew), then ``GroupShift``
    per client: the benchmark of ``configs/leaderboard/base.yaml`` (docs/leaderboard.md). No side information.

    Args:
        num_clients, partition, test_fraction, clients_per_round, participation, seed, val_fraction: as
            ``DigitsDataModule``.
        rotations, permute_labels, label_seed: as ``GroupShift`` (the group count is ``len(rotations)``).
    """

    def __init__(
        self,
        num_clients: int = 50,
        partition: Partitioner | None = None,
        test_fraction: float = 0.5,
        clients_per_round: int | None = None,
        participation: float | None = 0.2,
        seed: int | None = None,
        val_fraction: float = 0.0,
        rotations: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
        permute_labels: bool = True,
        label_seed: int = 0,
    ) -> None:
        partition = partition if partition is not None else Dirichlet(1.0, min_samples=5)
        base = DigitsDataModule(
            num_clients, partition, test_fraction, clients_per_round, participation, seed, val_fraction
        )
        shift = GroupShift(None, rotations, 10, permute_labels, label_seed)
        super().__init__(base, None, shift)
