"""LightningDataModules that build heterogeneous client partitions."""

from datamodules.base import FederatedDataModule
from datamodules.common import PartitionedDataModule
from datamodules.concept_shift import DigitsGroupShiftDataModule, GroupShift
from datamodules.digits import DigitsDataModule
from datamodules.digits_shift import DigitsShiftDataModule
from datamodules.feature_shift import FeatureShift, IIDSplit
from datamodules.hf import HFDataModule
from datamodules.leaf import FEMNISTDataModule, LeafDataModule, Sent140DataModule, ShakespeareDataModule
from datamodules.partition import Dirichlet, LogNormal, Natural, Partitioner, PerClientSplit, Shards
from datamodules.side_info import (
    ClientEmbedding,
    ClientOneHot,
    MissingSideInfo,
    NoisySideInfo,
    ShiftOneHot,
    SideInfo,
    SideInfoDataModule,
)
from datamodules.synthetic import SyntheticLinearDataModule
from datamodules.vision import (
    CIFAR10DataModule,
    CIFAR100DataModule,
    EMNISTDataModule,
    MNISTDataModule,
    OmniglotDataModule,
)

__all__ = ["Dirichlet", "DigitsDataModule", "FederatedDataModule", "Partitioner", "Shards", "SyntheticLinearDataModule"]
__all__ += [
    "ClientEmbedding",
    "ClientOneHot",
    "DigitsShiftDataModule",
    "FeatureShift",
    "GroupShift",
    "DigitsGroupShiftDataModule",
    "IIDSplit",
    "MissingSideInfo",
    "NoisySideInfo",
    "ShiftOneHot",
    "SideInfo",
    "SideInfoDataModule",
]
__all__ += [
    "CIFAR10DataModule",
    "CIFAR100DataModule",
    "EMNISTDataModule",
    "FEMNISTDataModule",
    "HFDataModule",
    "LeafDataModule",
    "LogNormal",
    "MNISTDataModule",
    "Natural",
    "OmniglotDataModule",
    "PartitionedDataModule",
    "PerClientSplit",
    "Sent140DataModule",
    "ShakespeareDataModule",
]

from datamodules.lowrank import LowRankDataModule, LowRankMetrics  # noqa: E402
from datamodules.mixed_regression import (  # noqa: E402
    MixedRegressionDataModule,
    MixedRegressionMetrics,
    StartFromGroundTruth,
)

__all__ += ["LowRankDataModule", "LowRankMetrics", "MixedRegressionDataModule", "MixedRegressionMetrics"]
__all__ += ["StartFromGroundTruth"]
