"""The linear representation model of FedRep's theory (spec 000 §2.1–2.2) and spec 004."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel


class LinearRepresentation(SplitModel):
    """``y = wᵢᵀ Bᵀ x`` (spec 000 §2.2): body = Bᵀ (a bias-free d→k linear map), head = wᵢ (k→1).

    ``B`` starts as the orthonormal Q factor of a Gaussian d×k matrix (spec 000 §5 [CHECK] setup), the head as
    N(0, I_k) (algorithms choose their own head start: ``LinearFedRep.head_init``, ``LinearFedAvg.init``).

    ``dim`` and ``rank`` default to the data module's (``data.init_args.dim``/``rank``, see ``data_sizes``):
    set them once, in the data; a different explicit value is a one-line error.
    """

    #: network argument → data-module argument that must agree (filled in from the data when unset)
    data_sizes = {"dim": "dim", "rank": "rank"}

    def __init__(self, dim: int | None = None, rank: int | None = None) -> None:
        if dim is None or rank is None:
            raise ConfigError(
                "LinearRepresentation: dim and rank are needed (train.py takes them from data.init_args.dim / rank)"
            )
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
