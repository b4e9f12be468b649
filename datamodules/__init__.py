"""LightningDataModules that build heterogeneous client partitions."""

from datamodules.base import FederatedDataModule
from datamodules.digits import DigitsDataModule
from datamodules.partition import Dirichlet, Partitioner, Shards
from datamodules.synthetic import SyntheticLinearDataModule

__all__ = ["Dirichlet", "DigitsDataModule", "FederatedDataModule", "Partitioner", "Shards", "SyntheticLinearDataModule"]
