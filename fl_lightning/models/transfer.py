"""The CNN of spec 004 §4.2: six 3×3 conv layers (ReLU, max-pool after every second) and a 3-layer ReLU MLP.

The paper gives only the structure and the 512-d penultimate layer; the widths here (32, 32, 64, 64, 128, 128
channels, padding 1, MLP 2048→512→512→classes) are our choice. Body = convs + the first two MLP layers (its
output is the 512-d feature of Figure 4); head = the final linear layer.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from fl_lightning.models.split import SplitModel


class TransferCNN(SplitModel):
    def __init__(
        self,
        num_classes: int = 80,
        in_channels: int = 3,
        image_size: int = 32,
        channels: tuple[int, ...] = (32, 32, 64, 64, 128, 128),
        hidden: int = 512,
    ) -> None:
        if len(channels) != 6 or image_size % 8:
            raise ValueError("TransferCNN needs 6 conv widths and an image size divisible by 8")
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        prev = in_channels
        for i, width in enumerate(channels, start=1):
            layers[f"conv{i}"] = nn.Conv2d(prev, width, 3, padding=1)
            layers[f"relu{i}"] = nn.ReLU()
            if i % 2 == 0:
                layers[f"pool{i // 2}"] = nn.MaxPool2d(2)
            prev = width
        layers["flatten"] = nn.Flatten()
        layers["fc1"] = nn.Linear(prev * (image_size // 8) ** 2, hidden)
        layers["relu_fc1"] = nn.ReLU()
        layers["fc2"] = nn.Linear(hidden, hidden)
        layers["relu_fc2"] = nn.ReLU()
        super().__init__(nn.Sequential(layers), nn.Linear(hidden, num_classes))
