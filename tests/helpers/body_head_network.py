"""A body/head network with side information and its numpy forward (features, head), for FedProto and the
representation helpers."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

D, H, C = 3, 2, 3  # input dim, feature dim, classes


def weights() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "body.weight": torch.randn(H, D, generator=g, dtype=torch.float64),
        "body.bias": torch.randn(H, generator=g, dtype=torch.float64),
        "head.weight": torch.randn(C, H, generator=g, dtype=torch.float64),
        "head.bias": torch.randn(C, generator=g, dtype=torch.float64),
    }


def inputs(n: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2, 2, 1, 0, 2][:n])
    return x, y


def np_features(p: dict[str, Tensor], x: Tensor) -> np.ndarray:
    return x.numpy() @ p["body.weight"].numpy().T + p["body.bias"].numpy()


def np_head(p: dict[str, Tensor], z: np.ndarray) -> np.ndarray:
    return z @ p["head.weight"].numpy().T + p["head.bias"].numpy()


class BodyHead(nn.Module):
    """A body and a head but no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, H)
        self.head = nn.Linear(H, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))
