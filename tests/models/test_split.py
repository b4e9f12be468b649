"""``fl_lightning/models/split.py``: ``head(side_branch(body(x), z))``, the two PerFedSI side branches, the fixed
group mask, and the layer builders, against the same arithmetic written out here."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from fl_lightning.models.split import Concat, GroupExpand, Mask, SplitModel, mlp_layers, without_batchnorm


def test_forward_is_the_head_of_the_body_and_features_is_the_body() -> None:
    torch.manual_seed(0)
    body, head = nn.Linear(4, 3), nn.Linear(3, 2)
    model, x = SplitModel(body, head), torch.randn(5, 4)
    expected = (x @ body.weight.T + body.bias) @ head.weight.T + head.bias
    torch.testing.assert_close(model(x), expected)
    torch.testing.assert_close(model.features(x), x @ body.weight.T + body.bias)
    assert [n for n, _ in model.named_parameters()] == ["body.weight", "body.bias", "head.weight", "head.bias"]


def test_concat_side_branch_feeds_the_head_features_then_the_embedded_side() -> None:
    torch.manual_seed(1)
    body, embed, head = nn.Linear(4, 3), nn.Linear(2, 2), nn.Linear(5, 1)
    model = SplitModel(body, head, Concat(embed))
    x, z = torch.randn(6, 4), torch.randn(6, 2)
    joined = torch.cat([x @ body.weight.T + body.bias, z @ embed.weight.T + embed.bias], dim=1)
    torch.testing.assert_close(model(x, z), joined @ head.weight.T + head.bias)
    with pytest.raises(ValueError, match="side-information branch but the data provide no side tensor"):
        model(x)


def test_mask_multiplies_each_channel_over_its_spatial_positions() -> None:
    features = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    z = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 0.0]])
    out = Mask(nn.Identity())(features, z)
    for n in range(2):
        for c in range(3):
            torch.testing.assert_close(out[n, c], features[n, c] * z[n, c])


def test_group_expand_gives_each_group_its_share_of_the_channels() -> None:
    z = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    expanded = GroupExpand(channels=6, groups=3)(z)
    assert expanded.tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="7 channels do not split into 3 groups"):
        GroupExpand(channels=7, groups=3)


def test_mlp_layers_and_without_batchnorm_keep_the_other_names() -> None:
    layers = mlp_layers([8, 5, 3])
    assert list(layers) == ["fc1", "relu1", "fc2", "relu2"]
    assert [(m.in_features, m.out_features) for m in layers.values() if isinstance(m, nn.Linear)] == [(8, 5), (5, 3)]
    assert list(mlp_layers([2, 2], prefix="h")) == ["h1", "relu1"]
    mixed = OrderedDict(conv=nn.Conv2d(1, 2, 3), bn=nn.BatchNorm2d(2), relu=nn.ReLU(), bn1d=nn.BatchNorm1d(4))
    assert list(without_batchnorm(mixed)) == ["conv", "relu"]
