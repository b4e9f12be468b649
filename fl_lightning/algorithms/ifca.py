"""FedX+clustering (spec 001 §2.3, Phase 2), which from a random start is IFCA (spec 001 §2.4 item 3).

Each round every client picks the cluster with the smallest residual ‖y_i − X_i θ_j‖ (eq. (8); ties go
to the smallest index), refines only that cluster's model by ``local_steps`` full-batch GD steps on
(1/(2nᵢ))‖y_i − X_iθ‖² (FedAvg) or by the exact proximal step (FedProx), and uploads all k models. The
server averages with weights nᵢ/N over all clients (engine ``aggregation: num_samples``, ``server_lr: 1``),
which gives the global iteration of Lemma 1, eq. (11). With ``num_clusters = 1`` this is global FedAvg.

The model is ``fl_lightning.models.ClusteredLinear`` (``theta`` [k, d], personal one-hot ``assign``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import LoopClient, Params
from fl_lightning.errors import ConfigError


def cluster_residuals(x: Tensor, y: Tensor, theta: Tensor) -> Tensor:
    """Eq. (8)'s squared residuals ‖y_i − X_iθ_j‖² of a batch of equally sized clients: x [B, n, d], y [B, n],
    theta [k, d] (the same models for every client) or [B, k, d] (each client its own) → [B, k]."""
    predicted = torch.einsum("bnd,kd->bnk" if theta.dim() == 2 else "bnd,bkd->bnk", x, theta)
    return ((y.unsqueeze(-1) - predicted) ** 2).sum(1)


def assign_clusters(x: Tensor, y: Tensor, theta: Tensor) -> Tensor:
    """Eq. (8) for a batch of equally sized clients: x [B, n, d], y [B, n], theta [k, d] → z [B]."""
    return cluster_residuals(x, y, theta).argmin(-1)


def refine(x: Tensor, y: Tensor, start: Tensor, lr: float, steps: int, solver: Literal["gd", "prox"] = "gd") -> Tensor:
    """The FedX local update (spec 001 §2.3 step 7) for a batch: x [B, n, d], y [B, n], start [B, d] → [B, d].

    ``gd``: ``steps`` steps θ ← θ − (η/n) Xᵀ(Xθ − y). ``prox``: θ = (I + (η/n)XᵀX)⁻¹(θ₀ + (η/n)Xᵀy).
    """
    n = x.shape[1]
    if solver == "prox":
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        gram = eye + (lr / n) * x.transpose(1, 2) @ x
        rhs = start + (lr / n) * (x.transpose(1, 2) @ y.unsqueeze(-1)).squeeze(-1)
        return torch.linalg.solve(gram, rhs)
    theta = start
    for _ in range(steps):
        grad = torch.einsum("bnd,bn->bd", x, torch.einsum("bnd,bd->bn", x, theta) - y)
        theta = theta - (lr / n) * grad
    return theta


def fedx_round(
    groups: list[tuple[Tensor, Tensor, Tensor]],
    theta: Tensor,
    lr: float,
    steps: int,
    solver: Literal["gd", "prox"] = "gd",
    labels: list[Tensor] | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """One global round of FedX+clustering over all clients, vectorised (the reference of eq. (11)).

    ``groups`` holds (x [B, n, d], y [B, n], weights [B]) blocks of equally sized clients, weights nᵢ/N.
    ``labels`` fixes each client's cluster (one-shot clustering); otherwise eq. (8) chooses it.
    Returns the new theta and each group's chosen clusters.
    """
    new = theta.clone()
    chosen = []
    for g, (x, y, w) in enumerate(groups):
        z = assign_clusters(x, y, theta) if labels is None else labels[g]
        moved = refine(x, y, theta[z], lr, steps, solver)
        new.index_add_(0, z, w.unsqueeze(-1) * (moved - theta[z]))
        chosen.append(z)
    return new, chosen


class IFCA(Algorithm):
    """Phase 2 of spec 001 on its own: clustered FedAvg/FedProx from the network's (random) ``theta``.

    Args:
        local_steps: s, full-batch GD steps per round (``gd``); ignored by ``prox``.
        lr: η of the local GD step, or of the proximal term 1/(2η).
        solver: ``gd`` (FedAvg-based) or ``prox`` (FedProx-based, exact closed form).
    """

    personal = ("assign",)
    reveals = "the client's cluster: only the row of theta it chose (its cluster label) moves, by GD on its data"
    supports_frozen = False  # closed-form steps on theta

    def __init__(self, local_steps: int = 5, lr: float = 0.05, solver: Literal["gd", "prox"] = "gd") -> None:
        super().__init__()
        if local_steps < 1 or lr <= 0:
            raise ConfigError(f"{type(self).__name__}: need local_steps ≥ 1 and lr > 0, got {local_steps}, {lr}")
        if solver not in ("gd", "prox"):
            raise ConfigError(f"{type(self).__name__}: solver must be 'gd' or 'prox', got {solver!r}")
        self.local_steps, self.lr, self.solver = local_steps, lr, solver

    # -- rounds before Phase 2 (none here; FedMD and one-shot clustering add theirs) ---------------------
    warmup_rounds: int = 0

    def extra_uploads(self, global_params: Params) -> Params:
        """Non-parameter upload keys of the warm-up rounds (zeros in Phase 2)."""
        return {}

    def warmup_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        raise NotImplementedError

    def choose_cluster(self, ctx: LoopClient, theta: Tensor) -> int:
        return int(assign_clusters(ctx.x.to(theta.dtype)[None], ctx.y.to(theta.dtype)[None], theta)[0])

    # -- hooks ------------------------------------------------------------------------------------------
    def init_client_state(self, global_params: Params) -> Params:
        return {"assign": global_params["assign"], "label": torch.tensor(-1.0, dtype=torch.float64)}

    def upload_template(self, global_params: Params) -> Params:
        return {"theta": global_params["theta"], **self.extra_uploads(global_params)}

    def download_template(self, global_params: Params) -> Params:
        return {"theta": global_params["theta"]}

    def complete(self, upload: Params, global_params: Params) -> Params:
        """Fill the template keys a round does not use with zeros (theta with its unchanged value)."""
        out = {"theta": global_params["theta"]}
        out.update({n: torch.zeros_like(v) for n, v in self.extra_uploads(global_params).items()})
        out.update(upload)
        return out

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        if ctx.round < self.warmup_rounds:
            return self.warmup_update(ctx, global_params, state)
        theta = global_params["theta"]
        x, y = ctx.x.to(theta.dtype), ctx.y.to(theta.dtype)
        z = self.choose_cluster(ctx, theta)
        moved = refine(x[None], y[None], theta[z][None], self.lr, self.local_steps, self.solver)[0]
        new = theta.clone()
        new[z] = moved
        assign = torch.zeros_like(global_params["assign"])
        assign[z] = 1.0
        loss = float(0.5 * ((y - x @ theta[z]) ** 2).mean())
        return ClientUpdate(
            self.complete({"theta": new}, global_params),
            {"assign": assign, "label": torch.tensor(float(z), dtype=torch.float64)},
            ctx.num_samples,
            loss,
        )
