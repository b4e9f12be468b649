"""Bundled-data stand-in for PerFedSI's CIFAR setting (spec 002 §4.3, §8 R4): scikit-learn digits, i.i.d. over
clients, upsampled to ``image_size`` (bilinear) so that four 2×2-pooling conv blocks fit, then one of the four
affine shift groups per client, with the one-hot shift group as side information.
"""

from __future__ import annotations

from torch.nn import functional as F

from datamodules.digits import DigitsDataModule
from datamodules.feature_shift import FeatureShift, IIDSplit
from datamodules.side_info import ShiftOneHot, SideInfo, SideInfoDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData


class DigitsShiftDataModule(SideInfoDataModule):
    """Digits with PerFedSI's four shift groups.

    Args:
        num_clients, test_fraction, clients_per_round, participation, seed, val_fraction: as
            ``DigitsDataModule`` (the partition is i.i.d.).
        image_size: side length after upsampling the 8×8 images.
        shift: the shift groups (default ``FeatureShift()``: the paper's four groups, balanced).
        side: the side information (default ``ShiftOneHot`` of the shift's groups).
    """

    def __init__(
        self,
        num_clients: int = 20,
        image_size: int = 16,
        test_fraction: float = 0.2,
        clients_per_round: int | None = None,
        participation: float | None = 0.2,
        seed: int | None = None,
        shift: FeatureShift | None = None,
        side: SideInfo | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        shift = shift if shift is not None else FeatureShift()
        base = DigitsDataModule(
            num_clients, IIDSplit(), test_fraction, clients_per_round, participation, seed, val_fraction
        )
        super().__init__(base, side if side is not None else ShiftOneHot(shift.num_groups), shift)
        self.image_size = image_size

    def prepare(self, fed: FederatedData) -> FederatedData:
        def resize(split: ClientSplit) -> ClientSplit:
            x = F.interpolate(split.x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
            return ClientSplit(x, split.y, split.ptr)

        return fed.map_splits(resize)
