"""``fl_lightning/models/digits.py``: the digits MLP and CNN computed by hand here (layer by layer with
``torch.nn.functional``), their parameter names, and the CNN's BatchNorm variant."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fl_lightning.models import DigitsCNN, DigitsMLP


def test_mlp_is_relu_layers_then_a_linear_head() -> None:
    torch.manual_seed(0)
    net = DigitsMLP(num_classes=7, hidden=(6, 5))
    p = dict(net.named_parameters())
    assert list(p) == ["body.fc1.weight", "body.fc1.bias", "body.fc2.weight", "body.fc2.bias", "head.weight",
                       "head.bias"]  # fmt: skip
    x = torch.randn(4, 8, 8)
    h = torch.relu(x.flatten(1) @ p["body.fc1.weight"].T + p["body.fc1.bias"])
    h = torch.relu(h @ p["body.fc2.weight"].T + p["body.fc2.bias"])
    torch.testing.assert_close(net(x), h @ p["head.weight"].T + p["head.bias"])


def test_cnn_two_conv_pool_blocks_then_fc_then_head() -> None:
    torch.manual_seed(1)
    net = DigitsCNN(num_classes=10)
    p = dict(net.named_parameters())
    x = torch.randn(3, 1, 8, 8)
    h = F.max_pool2d(torch.relu(F.conv2d(x, p["body.conv1.weight"], p["body.conv1.bias"], padding=1)), 2)
    h = F.max_pool2d(torch.relu(F.conv2d(h, p["body.conv2.weight"], p["body.conv2.bias"], padding=1)), 2)
    h = torch.relu(h.flatten(1) @ p["body.fc1.weight"].T + p["body.fc1.bias"])
    torch.testing.assert_close(net(x), h @ p["head.weight"].T + p["head.bias"])


def test_cnn_batchnorm_variant_adds_bn1_bn2_and_keeps_every_other_name() -> None:
    plain = {n for n, _ in DigitsCNN().named_parameters()}
    with_bn = {n for n, _ in DigitsCNN(batchnorm=True).named_parameters()}
    assert with_bn - plain == {"body.bn1.weight", "body.bn1.bias", "body.bn2.weight", "body.bn2.bias"}
    assert plain < with_bn
    assert DigitsCNN(batchnorm=True)(torch.randn(2, 1, 8, 8)).shape == (2, 10)
