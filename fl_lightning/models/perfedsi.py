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


class PerFedSIMask(SplitModel):
    """PerFedSI Model 2 (spec 002 eq. 4): ``f(x, z) = H(G(x) ⊙ W(z))`` with the mask after the conv-3 block.

    Args:
        mask: ``fixed`` = reading (a), ``W(z) = repeat_interleave(z, width/groups)`` (no parameters; a one-hot
            z keeps one quarter of the channels and zeroes the rest); ``learned`` = reading (b),
            ``W(z) = Wᵀz`` with ``W ∈ R^{groups×width}`` initialised to ones.
        groups: side-information dimension (4 shift groups).
    """

    def __init__(
        self,
        num_classes: int = 10,
        groups: int = 4,
        mask: Literal["fixed", "learned"] = "fixed",
        in_channels: int = 3,
        image_size: int = 32,
        width: int = 64,
    ) -> None:
        s = _spatial(image_size, 4)
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
        head = nn.Sequential(
            OrderedDict(
                **conv_stack(in_channels, width, range(4, 5)),
                flatten=nn.Flatten(),
                fc=nn.Linear(width * s * s, num_classes),
            )
        )
        super().__init__(body, head, Mask(embed))
