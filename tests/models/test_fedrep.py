"""``fl_lightning/models/fedrep.py``: the networks of FedRep's real-data experiments computed by hand here
(``torch.nn.functional`` on their own weights), their widths, the BatchNorm variant and its refusal."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.errors import ConfigError
from fl_lightning.models import CifarCNN, FemnistMLP, Sent140LSTM


def test_cifar_cnn_is_two_conv_pool_blocks_and_three_linear_layers() -> None:
    torch.manual_seed(0)
    net = CifarCNN(num_classes=10)
    p = dict(net.named_parameters())
    x = torch.randn(2, 3, 32, 32)
    h = F.max_pool2d(torch.relu(F.conv2d(x, p["body.conv1.weight"], p["body.conv1.bias"])), 2)
    h = F.max_pool2d(torch.relu(F.conv2d(h, p["body.conv2.weight"], p["body.conv2.bias"])), 2)
    h = torch.relu(h.flatten(1) @ p["body.fc1.weight"].T + p["body.fc1.bias"])
    h = torch.relu(h @ p["body.fc2.weight"].T + p["body.fc2.bias"])
    torch.testing.assert_close(net(x), h @ p["head.weight"].T + p["head.bias"])
    assert p["body.fc1.weight"].shape == (120, 1600) and p["head.weight"].shape == (10, 64)
    wide = dict(CifarCNN(num_classes=100, wide=True).named_parameters())
    assert wide["body.conv2.weight"].shape[0] == 128 and wide["body.fc1.weight"].shape == (256, 3200)
    assert wide["head.weight"].shape == (100, 128)
    bn = {n for n, _ in CifarCNN(batchnorm=True).named_parameters()} - set(p)
    assert bn == {"body.bn1.weight", "body.bn1.bias", "body.bn2.weight", "body.bn2.bias"}


def test_femnist_mlp_follows_the_authors_three_hidden_layers() -> None:
    net = FemnistMLP(num_classes=62)
    shapes = [tuple(t.shape) for n, t in net.named_parameters() if n.endswith("weight")]
    assert shapes == [(512, 784), (256, 512), (64, 256), (62, 64)]
    x = torch.randn(3, 1, 28, 28)
    p = dict(net.named_parameters())
    h = x.flatten(1)
    for i in (1, 2, 3):
        h = torch.relu(h @ p[f"body.fc{i}.weight"].T + p[f"body.fc{i}.bias"])
    torch.testing.assert_close(net(x), h @ p["head.weight"].T + p["head.bias"])


def test_sent140_lstm_reads_the_last_time_step() -> None:
    torch.manual_seed(1)
    net = Sent140LSTM(vocab_size=20, embed_dim=4, hidden=5, fc=3, freeze_embedding=True)
    assert not net.body.embedding.weight.requires_grad and net.body.lstm.weight_ih_l0.requires_grad
    tokens = torch.tensor([[3, 7, 1, 0], [2, 2, 9, 4]])
    lstm = net.body.lstm
    h, c = torch.zeros(2, 5), torch.zeros(2, 5)
    for t in range(4):  # the LSTM cell written out (gates i, f, g, o)
        gates = net.body.embedding.weight[tokens[:, t]] @ lstm.weight_ih_l0.T + lstm.bias_ih_l0
        gates = gates + h @ lstm.weight_hh_l0.T + lstm.bias_hh_l0
        i, f, g, o = gates.chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    features = torch.relu(h @ net.body.fc.weight.T + net.body.fc.bias)
    torch.testing.assert_close(net(tokens), features @ net.head.weight.T + net.head.bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("network", [FemnistMLP, Sent140LSTM])
def test_networks_without_a_batchnorm_variant_refuse_it_in_one_line(network) -> None:
    with pytest.raises(ConfigError, match=rf"^{network.__name__} has no BatchNorm variant"):
        network(batchnorm=True)
