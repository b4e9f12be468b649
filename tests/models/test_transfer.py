"""``fl_lightning/models/transfer.py``: spec 004 §4.2's CNN: six 3×3 convolutions with a pool after every second,
the 512-d feature of Figure 4 as the body's output, and the final linear layer as the head."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.models import TransferCNN


def test_six_convs_a_512_feature_and_a_linear_head():
    net = TransferCNN(num_classes=80)
    assert net.features(torch.zeros(2, 3, 32, 32)).shape == (2, 512)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 80)
    assert sum(isinstance(mod, nn.Conv2d) for mod in net.modules()) == 6
    assert sum(isinstance(mod, nn.MaxPool2d) for mod in net.modules()) == 3
    assert [n for n, _ in net.named_parameters() if n.startswith("head.")] == ["head.weight", "head.bias"]
    small = TransferCNN(num_classes=5, in_channels=1, image_size=16, channels=(2, 2, 3, 3, 4, 4), hidden=6)
    assert small.body.fc1.in_features == 4 * 2 * 2  # 16 / 8 = 2 after three pools
    assert small(torch.zeros(3, 1, 16, 16)).shape == (3, 5)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="6 conv widths and an image size divisible by 8"):
        TransferCNN(image_size=20)
    with pytest.raises(ValueError, match="6 conv widths"):
        TransferCNN(channels=(4, 4))
