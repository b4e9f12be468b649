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

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, features: Tensor, side: Tensor) -> Tensor:
        return torch.cat([features.flatten(1), self.embed(side).flatten(1)], dim=1)


class Mask(nn.Module):
    """PerFedSI Model 2 (spec 002 §2.2): the head sees ``G(x) ⊙ W(z)``.

    ``W(z)`` has one value per feature channel and is broadcast over spatial dimensions.
    """

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


def _mlp(sizes: list[int], prefix: str = "fc") -> OrderedDict[str, nn.Module]:
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        layers[f"{prefix}{i}"] = nn.Linear(a, b)
        layers[f"relu{i}"] = nn.ReLU()
    return layers


class CifarCNN(SplitModel):
    """The LG-FedAvg/FedRep 5-layer CNN (spec 000 §8.2, ``CNNCifar``): 2 conv + 3 FC, head = fc3.

    conv1 3→64 k5, pool, conv2 64→64 k5, pool, fc1 1600→120, fc2 120→64, head 64→classes.
    For CIFAR-100 the authors widen it (conv2 64→128, fc1 3200→256, fc2 256→128): ``wide=True``.
    """

    def __init__(self, num_classes: int = 10, wide: bool = False, in_channels: int = 3) -> None:
        c2, f1, f2 = (128, 256, 128) if wide else (64, 120, 64)
        body = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(in_channels, 64, 5),
                relu1=nn.ReLU(),
                pool1=nn.MaxPool2d(2),
                conv2=nn.Conv2d(64, c2, 5),
                relu2=nn.ReLU(),
                pool2=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc1=nn.Linear(c2 * 25, f1),
                relu3=nn.ReLU(),
                fc2=nn.Linear(f1, f2),
                relu4=nn.ReLU(),
            )
        )
        super().__init__(body, nn.Linear(f2, num_classes))


class FemnistMLP(SplitModel):
    """FedRep's FEMNIST MLP (spec 000 §8.2): 784→512→256→64 hidden, head 64→classes.

    The paper says "two hidden layers"; the authors' code has three. We follow the code's widths.
    """

    def __init__(self, num_classes: int = 10, in_features: int = 784, hidden: tuple[int, ...] = (512, 256, 64)):
        body = nn.Sequential(OrderedDict(flatten=nn.Flatten(), **_mlp([in_features, *hidden])))
        super().__init__(body, nn.Linear(hidden[-1], num_classes))


class DigitsMLP(SplitModel):
    """Small MLP for 8×8 digits: 64→hidden… →classes, head = final linear layer."""

    def __init__(self, num_classes: int = 10, hidden: tuple[int, ...] = (128, 64)) -> None:
        body = nn.Sequential(OrderedDict(flatten=nn.Flatten(), **_mlp([64, *hidden])))
        super().__init__(body, nn.Linear(hidden[-1], num_classes))


class DigitsCNN(SplitModel):
    """Small CNN for 1×8×8 digits: conv 1→16, conv 16→32 (3×3, pad 1, pool 2), fc 128→64, head 64→classes."""

    def __init__(self, num_classes: int = 10) -> None:
        body = nn.Sequential(
            OrderedDict(
                conv1=nn.Conv2d(1, 16, 3, padding=1),
                relu1=nn.ReLU(),
                pool1=nn.MaxPool2d(2),
                conv2=nn.Conv2d(16, 32, 3, padding=1),
                relu2=nn.ReLU(),
                pool2=nn.MaxPool2d(2),
                flatten=nn.Flatten(),
                fc1=nn.Linear(128, 64),
                relu3=nn.ReLU(),
            )
        )
        super().__init__(body, nn.Linear(64, num_classes))


class LinearRepresentation(SplitModel):
    """``y = wᵢᵀ Bᵀ x`` (spec 000 §2.2): body = Bᵀ (a bias-free d→k linear map), head = wᵢ (k→1).

    ``B`` starts as the orthonormal Q factor of a Gaussian d×k matrix (spec 000 §5 [CHECK] setup).
    """

    def __init__(self, dim: int = 10, rank: int = 2) -> None:
        body = nn.Linear(dim, rank, bias=False)
        head = nn.Linear(rank, 1, bias=False)
        with torch.no_grad():
            q, _ = torch.linalg.qr(torch.randn(dim, rank))
            body.weight.copy_(q.T)
            head.weight.normal_()
        super().__init__(body, head)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return super().forward(x, side).squeeze(-1)

    @property
    def representation(self) -> Tensor:
        """B (d×k)."""
        return self.body.weight.T
