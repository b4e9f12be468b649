"""A model that counts its forward calls, for the L2GD and FedALA client-model tests."""

from __future__ import annotations

import torch
from torch import nn

D = 3


class Counted(nn.Module):
    """A linear layer plus an integer buffer (like BatchNorm's ``num_batches_tracked``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, 1, dtype=torch.float64)
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(x)
