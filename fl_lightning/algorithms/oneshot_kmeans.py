"""One-shot clustering (spec 001 §2.4 item 2, [GHYR19]): local estimates → k-means once → FedAvg per cluster.

Round 0: every client uploads its local minimum-norm least-squares estimate θ̂ᵢ = X_i⁺ y_i (the spec's
suggestion for nᵢ < d); the server runs k-means (k-means++, ``restarts`` restarts, seeded) on the M
estimates, keeps the labels fixed for ever and starts cluster j's model at its k-means centre.
Later rounds: FedX (``IFCA``'s local update and nᵢ/N averaging) with each client's cluster fixed.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate, RoundFacts
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.client import LoopClient, Params


def local_estimate(x: Tensor, y: Tensor) -> Tensor:
    """Minimum-norm least squares X⁺y."""
    return torch.linalg.pinv(x) @ y


def kmeans(points: Tensor, k: int, seed: int = 0, restarts: int = 10) -> tuple[Tensor, Tensor]:
    """k-means (sklearn, k-means++ init): returns (labels [M], centres [k, d])."""
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=k, n_init=restarts, random_state=seed).fit(points.double().cpu().numpy())
    return torch.as_tensor(km.labels_, dtype=torch.long), torch.as_tensor(km.cluster_centers_, dtype=points.dtype)


class OneShotClustering(IFCA):
    """One-shot clustering baseline; ``local_steps``/``lr``/``solver`` are the per-cluster FedAvg's."""

    warmup_rounds = 1
    reveals = "round 0: the client's own least-squares estimate θ̂_i (its row; every estimate is seen); then its cluster"

    def __init__(
        self,
        seed: int = 0,
        restarts: int = 10,
        local_steps: int = 5,
        lr: float = 0.05,
        solver: Literal["gd", "prox"] = "gd",
    ) -> None:
        super().__init__(local_steps, lr, solver)
        self.seed, self.restarts = seed, restarts

    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        self.register_buffer("labels", torch.zeros(num_clients, dtype=torch.long))

    def extra_uploads(self, global_params: Params) -> Params:
        theta = global_params["theta"]
        return {
            "estimates": torch.zeros(self.num_clients, theta.shape[1], dtype=theta.dtype),
            "estimate_mask": torch.zeros(self.num_clients, dtype=theta.dtype),
        }

    def warmup_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        theta = global_params["theta"]
        est = torch.zeros(self.num_clients, theta.shape[1], dtype=theta.dtype)
        mask = torch.zeros(self.num_clients, dtype=theta.dtype)
        est[ctx.client] = local_estimate(ctx.x.to(theta.dtype), ctx.y.to(theta.dtype))
        mask[ctx.client] = 1.0
        return ClientUpdate(
            self.complete({"estimates": est, "estimate_mask": mask}, global_params), dict(state), ctx.num_samples
        )

    def choose_cluster(self, ctx: LoopClient, theta: Tensor) -> int:
        return int(self.labels[ctx.client])

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if facts.round != 0:
            return
        mask = averaged_extra["estimate_mask"]
        estimates = averaged_extra["estimates"] / mask.clamp(min=1e-300).unsqueeze(-1)
        labels, centres = kmeans(estimates, global_params["theta"].shape[0], self.seed, self.restarts)
        self.labels.copy_(labels)
        global_params["theta"].copy_(centres.to(global_params["theta"].dtype))
