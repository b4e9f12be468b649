"""Split models: a shared body φ, a personal head h, and an optional side-information branch.

``SplitModel.forward(x, side)`` computes ``head(side_branch(body(x), side))``. Algorithms address
parameters by name prefix (``body.``, ``head.``, ``side.`` or finer, e.g. ``body.conv1``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn


class Concat(nn.Module):
    """PerFedSI Model 1 (spec 002 §2.1): the head sees ``[G(x), W(z)]``."""

    reveals = "every upload is trained with W(z): the side branch's and the head's updates are functions of z"

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, features: Tensor, side: Tensor) -> Tensor:
        return torch.cat([features.flatten(1), self.embed(side).flatten(1)], dim=1)


class Mask(nn.Module):
    """PerFedSI Model 2 (spec 002 §2.2): the head sees ``G(x) ⊙ W(z)``.

    ``W(z)`` has one value per feature channel and is broadcast over spatial dimensions.
    """

    reveals = (
        "z's group: weights that only meet masked-out channels get no gradient, so which ones move shows the "
        "client's side-information group (fixed mask: its share of the channels; learned mask: its column of W)"
    )

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, features: Tensor, side: Tensor) -> Tensor:
        mask = self.embed(side)
        mask = mask.view(*mask.shape, *([1] * (features.dim() - mask.dim())))
        return features * mask


class GroupExpand(nn.Module):
    """Fixed mask of spec 002 §2.5 reading (a): one-hot ``z`` → each group owns ``channels/len(z)`` channels."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        if channels % groups:
            raise ValueError(f"GroupExpand: {channels} channels do not split into {groups} groups")
        self.repeats = channels // groups

    def forward(self, side: Tensor) -> Tensor:
        return side.repeat_interleave(self.repeats, dim=-1)


class SplitModel(nn.Module):
    """``head(side_branch(body(x), z))`` with the side branch optional."""

    def __init__(self, body: nn.Module, head: nn.Module, side: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.head = head
        self.side = side

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        features = self.body(x)
        if self.side is not None:
            if side is None:
                raise ValueError("this model has a side-information branch but the data provide no side tensor")
            features = self.side(features, side)
        return self.head(features)

    def features(self, x: Tensor) -> Tensor:
        """The body's output φ(x) (what a head-only phase sees when there is no side branch)."""
        return self.body(x)


def mlp_layers(sizes: list[int], prefix: str = "fc") -> OrderedDict[str, nn.Module]:
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        layers[f"{prefix}{i}"] = nn.Linear(a, b)
        layers[f"relu{i}"] = nn.ReLU()
    return layers


def without_batchnorm(layers: OrderedDict[str, nn.Module]) -> OrderedDict[str, nn.Module]:
    """``layers`` minus its BatchNorm layers (a network's plain variant; the other names are unchanged)."""
    return OrderedDict((n, m) for n, m in layers.items() if not isinstance(m, nn.modules.batchnorm._BatchNorm))
