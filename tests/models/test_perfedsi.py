"""``fl_lightning/models/perfedsi.py``: PerFedSI's concat and mask networks (spec 002 §2) and the side-group BatchNorm,
against plain torch ops on the models' weights, and their one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.errors import ConfigError
from fl_lightning.models import ConvNet4, PerFedSIConcat, PerFedSIMask
from tests.helpers.asserts import assert_close_finite


def ref_block(h: torch.Tensor, sd: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    """Conv3×3(pad 1) → BatchNorm (eval: running statistics) → ReLU → MaxPool 2×2."""
    h = F.conv2d(h, sd[p + "conv.weight"], sd[p + "conv.bias"], padding=1)
    scale = sd[p + "bn.weight"] / torch.sqrt(sd[p + "bn.running_var"] + 1e-5)
    h = (h - sd[p + "bn.running_mean"][:, None, None]) * scale[:, None, None] + sd[p + "bn.bias"][:, None, None]
    return F.max_pool2d(h.clamp(min=0), 2)


def randomize(net: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Non-trivial weights and BN statistics; eval mode; returns the state dict."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(net.named_parameters()) + list(net.named_buffers()):
            if name.endswith("running_var"):
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            else:
                t.copy_(0.3 * torch.randn(t.shape, generator=g))
    net.eval()
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_concat_branch_is_h_of_concatenation_and_a_client_logit_bias():
    net = PerFedSIConcat(num_classes=7, side_dim=5, in_channels=1, image_size=16, width=4)
    sd = randomize(net)
    x, z = torch.randn(3, 1, 16, 16), torch.randn(3, 5)
    g = x
    for i in range(1, 5):
        g = ref_block(g, sd, f"body.conv{i}.")
    g = g.flatten(1)  # G(x): 4·1·1
    w = F.linear(z, sd["side.embed.fc.weight"], sd["side.embed.fc.bias"]).view(3, 4, 3, 3)
    w = ref_block(w, sd, "side.embed.conv.").flatten(1)  # W(z): Linear → (width, 3, 3) → conv block
    expected = torch.cat([g, w], 1) @ sd["head.weight"].T + sd["head.bias"]
    out = net(x, z)
    assert_close_finite(out, expected, rtol=1e-5, atol=1e-6)
    assert g.shape[1] == net.embedding_dim == 4 and net.head.in_features == 4 + 4
    # H linear ⇒ f = H'G(x) + H''W(z) + b: changing z shifts every input's logits by the same vector
    z2 = torch.randn(1, 5).expand(3, 5)
    shift = net(x, z2) - net(x, z[:1].expand(3, 5))
    assert_close_finite(shift, shift[:1].expand(3, 7), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["fixed", "learned"])
def test_mask_branch_is_h_of_elementwise_product(mask):
    net = PerFedSIMask(num_classes=6, groups=4, mask=mask, in_channels=2, image_size=16, width=8)
    sd = randomize(net, seed=1)
    x = torch.randn(4, 2, 16, 16)
    z = torch.eye(4)[[2, 0, 3, 1]]
    g = x
    for i in range(1, 4):
        g = ref_block(g, sd, f"body.conv{i}.")  # G(x) = conv-3 features, [4, 8, 2, 2]
    if mask == "fixed":  # reading (a): channel c belongs to group c // (8/4)
        w = torch.stack([z[:, c // 2] for c in range(8)], 1)
    else:  # reading (b): W(z) = Wᵀz
        w = z @ sd["side.embed.weight"].T
    h = ref_block(g * w[:, :, None, None], sd, "head.conv4.").flatten(1)
    expected = h @ sd["head.fc.weight"].T + sd["head.fc.bias"]
    assert_close_finite(net(x, z), expected, rtol=1e-5, atol=1e-6)
    if mask == "fixed":  # a one-hot z zeroes exactly 3/4 of the conv-3 channels
        w_model = net.side.embed(z)
        assert (w_model == 0).sum(1).tolist() == [6, 6, 6, 6] and torch.equal(w_model, w)
        assert net.side(net.body(x), z)[w_model == 0].abs().sum() == 0
    else:  # initialised to ones: starts as "no mask" (Remark 2.2)
        assert torch.equal(PerFedSIMask(mask="learned").side.embed.weight, torch.ones(64, 4))


def test_side_batchnorm_keeps_and_uses_per_group_statistics():
    net = PerFedSIMask(num_classes=6, groups=4, mask="fixed", in_channels=1, image_size=16, width=8, norm="side")
    sd = randomize(net, seed=2)
    x, z = torch.randn(4, 1, 16, 16), torch.eye(4)[[3, 1, 0, 1]]
    g = x
    for i in range(1, 4):
        g = ref_block(g, sd, f"body.conv{i}.")
    w = torch.stack([z[:, c // 2] for c in range(8)], 1)
    h = F.conv2d(g * w[:, :, None, None], sd["head.conv4.conv.weight"], sd["head.conv4.conv.bias"], padding=1)
    mean, var = z @ sd["head.conv4.bn.running_mean"], z @ sd["head.conv4.bn.running_var"]  # each sample's group row
    h = (h - mean[:, :, None, None]) / torch.sqrt(var[:, :, None, None] + 1e-5)
    h = h * sd["head.conv4.bn.weight"][:, None, None] + sd["head.conv4.bn.bias"][:, None, None]
    expected = F.max_pool2d(h.clamp(min=0), 2).flatten(1) @ sd["head.fc.weight"].T + sd["head.fc.bias"]
    assert_close_finite(net(x, z), expected, rtol=1e-5, atol=1e-6)
    # training on a batch of group 2 moves only row 2 of the statistics, by momentum 0.1 towards the batch's
    net.train()
    before = {n: b.clone() for n, b in net.named_buffers() if n.startswith("head.conv4.bn")}
    feats = net.side(net.body(x), torch.eye(4)[[2] * 4])
    pre = net.head.conv4.conv(feats)
    net(x, torch.eye(4)[[2] * 4])
    rm, rv = net.head.conv4.bn.running_mean, net.head.conv4.bn.running_var
    assert_close_finite(rm[[0, 1, 3]], before["head.conv4.bn.running_mean"][[0, 1, 3]])
    assert_close_finite(rm[2], 0.9 * before["head.conv4.bn.running_mean"][2] + 0.1 * pre.mean((0, 2, 3)))
    assert_close_finite(rv[2], 0.9 * before["head.conv4.bn.running_var"][2] + 0.1 * pre.var((0, 2, 3)))


def test_bad_model_configs_are_one_line_errors():
    with pytest.raises(ConfigError, match="do not split into 3 groups"):
        PerFedSIMask(groups=3, width=64)
    with pytest.raises(ConfigError, match="too small"):
        ConvNet4(image_size=8)
    with pytest.raises(ConfigError, match="'fixed' or 'learned'"):
        PerFedSIMask(mask="soft")
    with pytest.raises(ConfigError, match="'shared' or 'side'"):
        PerFedSIMask(norm="group")
