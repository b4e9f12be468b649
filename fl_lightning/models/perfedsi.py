"""PerFedSI's networks (spec 002 §2.5): the four-conv-block CNN and its two side-information models.

Every conv block is ``Conv3×3(pad 1) → BatchNorm → ReLU → MaxPool 2×2`` (spec 002 §2.5 suggestion), named
``conv1`` … ``conv4`` so that algorithms can address whole blocks (``body.conv1.``) including their BN.

* ``ConvNet4``: ``G`` = conv1–4 + flatten, head = final linear layer. The baselines' network
  (FedAvg, Local, Ditto, SR-PH = personal ``head.``, PR-SH = personal ``body.conv1.``/``body.conv2.``).
* ``PerFedSIConcat``: Model 1, ``H([G(x), W(z)])`` (spec 002 eq. 3, Omniglot): ``W`` = Linear(side_dim →
  width·3·3) → reshape (width, 3, 3) → conv block → flatten (width), and ``H`` = Linear over both.
* ``PerFedSIMask``: Model 2, ``H(G(x) ⊙ W(z))`` (spec 002 eq. 4, CIFAR): ``G`` = conv1–3 (after pooling),
  ``H`` = conv4 + flatten + linear. ``W`` is reading (a) ``fixed``: one-hot ``z`` expanded to disjoint channel
  groups (``GroupExpand``), or reading (b) ``learned``: ``Linear(groups → width, bias=False)`` initialised to
  ones, i.e. one learned per-shift channel scaling that starts as "no mask" (Remark 2.2).

BatchNorm layers carry no ``num_batches_tracked`` buffer: it is unused with a fixed ``momentum`` and the
engine's delta averaging cannot average an integer buffer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.split import Concat, GroupExpand, Mask, SplitModel


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """``BatchNorm2d`` without the integer ``num_batches_tracked`` buffer (unused with momentum 0.1)."""
    bn = nn.BatchNorm2d(channels)
    bn.register_buffer("num_batches_tracked", None)
    return bn


def conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """``Conv3×3(pad 1) → BN → ReLU → MaxPool 2×2``: halves the spatial size (floor)."""
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(in_channels, out_channels, 3, padding=1),
            bn=batch_norm(out_channels),
            relu=nn.ReLU(),
            pool=nn.MaxPool2d(2),
        )
    )


def _spatial(image_size: int, blocks: int) -> int:
    size = image_size
    for _ in range(blocks):
        size //= 2
    if size < 1:
        raise ConfigError(f"image_size={image_size} is too small for {blocks} conv blocks with 2×2 pooling")
    return size


def conv_stack(in_channels: int, width: int, blocks: range) -> OrderedDict[str, nn.Module]:
    """Blocks ``conv{i}`` for i in ``blocks`` (1-based); block 1 takes ``in_channels``."""
    return OrderedDict((f"conv{i}", conv_block(in_channels if i == 1 else width, width)) for i in blocks)


class ConvNet4(SplitModel):
    """Four conv blocks + a final linear layer (spec 002 §2.5). ``body`` = conv1–4 + flatten, ``head`` = linear.

    With the defaults (3×32×32, width 64) the flattened body output is 64·2·2 = 256, the dimension the paper
    states for Omniglot's embedding (l. 625).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, width: int = 64) -> None:
        s = _spatial(image_size, 4)
        body = nn.Sequential(OrderedDict(**conv_stack(in_channels, width, range(1, 5)), flatten=nn.Flatten()))
        super().__init__(body, nn.Linear(width * s * s, num_classes))
        self.embedding_dim = width * s * s


class SideConvBranch(nn.Module):
    """Omniglot's "two-layer mapping" of z (spec 002 §2.5): Linear(side_dim → width·3·3) → (width, 3, 3) →
    conv block → flatten, giving ``width`` features (576 = 64·3·3 with the default width)."""

    def __init__(self, side_dim: int = 256, width: int = 64) -> None:
        super().__init__()
        self.width = width
        self.fc = nn.Linear(side_dim, width * 9)
        self.conv = conv_block(width, width)

    def forward(self, z: Tensor) -> Tensor:
        return self.conv(self.fc(z).view(-1, self.width, 3, 3)).flatten(1)


class PerFedSIConcat(SplitModel):
    """PerFedSI Model 1 (spec 002 eq. 3): ``f(x, z) = H([G(x), W(z)])``; all parameters are global.

    ``G`` = conv1–4 + flatten (``width·s·s`` features), ``W`` = ``SideConvBranch`` (``width`` features),
    ``H`` = Linear(``width·s·s + width`` → classes). Omniglot: 1,623 classes, ``side_dim`` 256.
    """

    def __init__(
        self,
        num_classes: int = 1623,
        side_dim: int = 256,
        in_channels: int = 1,
        image_size: int = 32,
        width: int = 64,
    ) -> None:
        s = _spatial(image_size, 4)
        body = nn.Sequential(OrderedDict(**conv_stack(in_channels, width, range(1, 5)), flatten=nn.Flatten()))
        side = Concat(SideConvBranch(side_dim, width))
        super().__init__(body, nn.Linear(width * s * s + width, num_classes), side)
        self.embedding_dim = width * s * s


class SideBatchNorm2d(nn.Module):
    """BatchNorm2d with running statistics per side-information group (``running_mean``/``running_var`` are
    ``[groups, C]``; γ, β shared). Training normalises with the batch statistics and moves row g by
    ``momentum · (share of the batch with z = e_g)``; evaluation normalises with ``zᵀ running_*``.
    In the engine every batch belongs to one client, hence one group."""

    def __init__(self, channels: int, groups: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(groups, channels))
        self.register_buffer("running_var", torch.ones(groups, channels))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        if self.training:
            mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
            n = x.numel() // x.shape[1]
            with torch.no_grad():
                share = self.momentum * z.float().mean(0).unsqueeze(1)
                self.running_mean.mul_(1 - share).add_(share * mean)
                self.running_var.mul_(1 - share).add_(share * var * n / max(n - 1, 1))
            mean, var = mean.expand(x.shape[0], -1), var.expand(x.shape[0], -1)
        else:
            mean, var = z @ self.running_mean, z @ self.running_var
        scale = self.weight / torch.sqrt(var + self.eps)
        return (x - mean[:, :, None, None]) * scale[:, :, None, None] + self.bias[:, None, None]


class SideConvBlock(nn.Module):
    """``conv_block`` whose BatchNorm keeps per-group statistics (``SideBatchNorm2d``); ``forward(x, z)``."""

    def __init__(self, in_channels: int, out_channels: int, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.bn = SideBatchNorm2d(out_channels, groups)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x), z)))


class SideHead(nn.Module):
    """PerFedSIMask's head with ``norm="side"``: conv4 (per-group BN statistics) → flatten → linear."""

    def __init__(self, width: int, groups: int, features: int, num_classes: int) -> None:
        super().__init__()
        self.conv4 = SideConvBlock(width, width, groups)
        self.fc = nn.Linear(features, num_classes)

    def forward(self, h: Tensor, z: Tensor) -> Tensor:
        return self.fc(self.conv4(h, z).flatten(1))


class PerFedSIMask(SplitModel):
    """PerFedSI Model 2 (spec 002 eq. 4): ``f(x, z) = H(G(x) ⊙ W(z))`` with the mask after the conv-3 block.

    Args:
        mask: ``fixed`` = reading (a), ``W(z) = repeat_interleave(z, width/groups)`` (no parameters; a one-hot
            z keeps one quarter of the channels and zeroes the rest); ``learned`` = reading (b),
            ``W(z) = Wᵀz`` with ``W ∈ R^{groups×width}`` initialised to ones.
        groups: side-information dimension (4 shift groups).
        norm: BatchNorm statistics of conv4, the layer after the mask. ``shared`` (the paper's network read
            literally): one set of running statistics, averaged by FedAvg like every buffer. ``side`` (our
            option, not in the paper): one set per side-information group, selected by z
            (``SideBatchNorm2d``). With a fixed mask, conv4's input channels differ by group, so its batch
            statistics do too, and evaluating with their cross-group average mis-normalises every group.
            Still fully global and trained with plain FedAvg.
    """

    def __init__(
        self,
        num_classes: int = 10,
        groups: int = 4,
        mask: Literal["fixed", "learned"] = "fixed",
        in_channels: int = 3,
        image_size: int = 32,
        width: int = 64,
        norm: Literal["shared", "side"] = "shared",
    ) -> None:
        s = _spatial(image_size, 4)
        if norm not in ("shared", "side"):
            raise ConfigError(f"PerFedSIMask.norm must be 'shared' or 'side', got {norm!r}")
        if mask == "fixed":
            if width % groups:
                raise ConfigError(f"PerFedSIMask: width={width} channels do not split into {groups} groups")
            embed: nn.Module = GroupExpand(width, groups)
        elif mask == "learned":
            embed = nn.Linear(groups, width, bias=False)
            nn.init.ones_(embed.weight)
        else:
            raise ConfigError(f"PerFedSIMask.mask must be 'fixed' or 'learned', got {mask!r}")
        body = nn.Sequential(conv_stack(in_channels, width, range(1, 4)))
        head: nn.Module = nn.Sequential(
            OrderedDict(
                **conv_stack(in_channels, width, range(4, 5)),
                flatten=nn.Flatten(),
                fc=nn.Linear(width * s * s, num_classes),
            )
        )
        if norm == "side":
            head = SideHead(width, groups, width * s * s, num_classes)
        super().__init__(body, head, Mask(embed))
        self.norm = norm

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        if self.norm == "shared":
            return super().forward(x, side)
        if side is None:
            raise ValueError("this model has a side-information branch but the data provide no side tensor")
        return self.head(self.side(self.body(x), side), side)
