"""PFLlib's ``FedAvgCNN`` shape, used by the speed benchmark (conv 3→32→64 5×5, fc 1600→512, head 512→10)."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from fl_lightning.models.split import SplitModel


class FedAvgCNN(SplitModel):
    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        body = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(in_channels, 32, 5),
                relu1=nn.ReLU(),
                pool1=nn.MaxPool2d(2),
                conv2=nn.Conv2d(32, 64, 5),
                relu2=nn.ReLU(),
                pool2=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc1=nn.Linear(1600, 512),
                relu3=nn.ReLU(),
            )
        )
        super().__init__(body, nn.Linear(512, num_classes))
