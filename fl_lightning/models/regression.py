"""Models whose "global model" is a parameter matrix rather than a network: k cluster linear models
(spec 001) and the shared right factor of a low-rank factorisation (spec 003)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError


class ClusteredLinear(nn.Module):
    """k linear models ``theta`` [k, d] (spec 001 eq. (1), φ(x) = x) and a client's cluster choice.

    ``assign`` [k] is the (personal) one-hot cluster indicator λ of spec 001 eq. (7); a client predicts
    with ``x · (λᵀ theta)``. ``theta`` starts as ``init_scale · N(0, I)`` rows (spec 001 §3.2, "random
    initialisation"; the paper's scale is unreadable, 1/√d is the documented choice). ``dim`` defaults to the
    data module's (``data_sizes``); ``num_clusters`` is the method's (1 is global FedAvg), not the data's.
    Oracle comparators start ``theta`` at the ground truth with ``datamodules.StartFromGroundTruth``.
    """

    data_sizes = {"dim": "dim"}

    def __init__(
        self, num_clusters: int = 3, dim: int | None = None, init_scale: float | None = None, seed: int = 0
    ) -> None:
        super().__init__()
        if dim is None or dim < 1 or num_clusters < 1:
            raise ConfigError(f"ClusteredLinear: need dim ≥ 1 (train.py takes it from data.init_args.dim) and "
                              f"num_clusters ≥ 1, got dim={dim}, num_clusters={num_clusters}")  # fmt: skip
        scale = dim**-0.5 if init_scale is None else init_scale
        g = torch.Generator().manual_seed(seed)
        self.theta = nn.Parameter(scale * torch.randn(num_clusters, dim, generator=g, dtype=torch.float64))
        assign = torch.zeros(num_clusters, dtype=torch.float64)
        assign[0] = 1.0
        self.register_buffer("assign", assign)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return x.to(self.theta.dtype) @ (self.assign @ self.theta)


class LowRankFactors(nn.Module):
    """``S ≈ U Vᵀ`` (spec 003 §1.3): the shared ``V`` [d, r] and a client's own ``U`` [max_rows, r].

    A client's inputs are its local row indices; ``forward`` returns the reconstructed rows ``U[x] Vᵀ``.
    ``U`` is padded to ``max_rows`` (the largest client) so that every client's U fits one bank row.
    Both start at zero: the algorithms (power initialisation, Ward–Kolda init) set them.

    From the data module when unset (``data_sizes``): ``dim`` (must agree), and as defaults only ``rank`` (the
    factorisation rank r may differ from the synthetic matrix's rank r*, spec 003 Thm 3) and ``max_rows``
    (``rows_per_client``; larger is fine, and a too small value is reported when a client does not fit).
    """

    data_sizes = {"dim": "dim", "rank": "rank", "max_rows": "rows_per_client"}
    data_defaults_only = frozenset({"rank", "max_rows"})

    def __init__(self, dim: int | None = None, rank: int | None = None, max_rows: int | None = None) -> None:
        super().__init__()
        if dim is None or rank is None or max_rows is None:
            raise ConfigError(
                "LowRankFactors: dim, rank and max_rows are needed (train.py takes them from data.init_args.dim, "
                "rank and rows_per_client)"
            )
        self.V = nn.Parameter(torch.zeros(dim, rank, dtype=torch.float64))
        self.U = nn.Parameter(torch.zeros(max_rows, rank, dtype=torch.float64))

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.U[x.long()] @ self.V.T
