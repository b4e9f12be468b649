"""Small networks shared by the unit tests."""

from __future__ import annotations

import torch


class LinearRegressor(torch.nn.Module):
    """``⟨w, x⟩ (+ b)`` as a ``[N]`` output, with the engine's forward signature (``side`` information, unused): the
    one-parameter-tensor network of the algorithm unit tests (parameter ``fc.weight``, and ``fc.bias``)."""

    def __init__(self, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(in_features, 1, bias=bias)

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x).squeeze(-1)
