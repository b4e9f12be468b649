"""The linear representation model of FedRep's theory (spec 000 §2.1–2.2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fl_lightning.models.split import SplitModel


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
