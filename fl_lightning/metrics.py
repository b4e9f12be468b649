"""Per-client metrics (torchmetrics states, sum-reduced across ranks) and the papers' metrics."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric


class PerClientScores(Metric):
    """``correct[c]``, ``total[c]``, ``loss_sum[c]`` for every client; each rank fills its own clients.

    ``dist_reduce_fx="sum"`` makes ``compute()`` return every client's numbers on every rank.
    """

    full_state_update = False

    def __init__(self, num_clients: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("loss_sum", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")

    def update(
        self, client: int | Tensor, correct: Tensor | float, total: int | Tensor, loss_sum: Tensor | float
    ) -> None:
        """One client's sums, or several clients' (``client`` a tensor of distinct ids, the sums ``[K]``)."""
        self.correct[client] += correct
        self.total[client] += total
        self.loss_sum[client] += loss_sum

    def compute(self) -> dict[str, Tensor]:
        has_data = self.total > 0
        total = self.total.clamp(min=1)
        acc, loss = self.correct / total, self.loss_sum / total
        return {
            "acc_per_client": acc,
            "loss_per_client": loss,
            "acc_mean": acc[has_data].mean(),
            "acc_weighted": self.correct.sum() / self.total.sum().clamp(min=1),
            "loss_mean": loss[has_data].mean(),
            "samples_per_client": self.total,
        }


def client_spread(values: Tensor, samples: Tensor, higher_is_better: bool = True) -> dict[str, float]:
    """How a per-client figure spreads over the clients that have test data (``samples > 0``): ``std`` (the
    population standard deviation over clients), ``worst10`` (the mean over the worst 10 % of them, at least one
    client: the lowest accuracies, or the highest errors) and ``worst`` (the single worst client)."""
    v = values[samples > 0].double()
    if v.numel() == 0:
        return {"std": float("nan"), "worst10": float("nan"), "worst": float("nan")}
    k = max(1, math.ceil(0.1 * v.numel()))
    ordered = torch.sort(v, descending=not higher_is_better).values
    return {
        "std": float(v.std(unbiased=False)),
        "worst10": float(ordered[:k].mean()),
        "worst": float(ordered[0]),
    }


def orthonormal_basis(b: Tensor) -> Tensor:
    q, _ = torch.linalg.qr(b)
    return q


def principal_angle_distance(b1: Tensor, b2: Tensor) -> Tensor:
    """dist(B1, B2) = ‖(I − Q1Q1ᵀ) Q2‖₂ (spec 000 Definition 1): sine of the largest principal angle."""
    q1, q2 = orthonormal_basis(b1.double()), orthonormal_basis(b2.double())
    residual = q2 - q1 @ (q1.T @ q2)
    return torch.linalg.matrix_norm(residual, ord=2)


def cluster_model_distance(theta: Tensor, theta_star: Tensor) -> tuple[float, tuple[int, ...]]:
    """d(θ̂, θ*) = min over assignments π of max_j ‖θ̂_{π(j)} − θ*_j‖ (spec 001 eq. (6)); returns (d, π).

    π maps each true cluster j to a model π(j). With at least as many models as clusters (k̂ ≥ k) π is
    injective (a permutation when k̂ = k): the bottleneck assignment, found exactly by bisecting the sorted
    pairwise distances with a bipartite matching at each threshold. With fewer models (k̂ < k, e.g. global
    FedAvg's one model) several clusters must share a model, so each is matched to its closest model:
    d = max_j min_i ‖θ̂_i − θ*_j‖ (every true cluster counts; never ``inf``).
    """
    from scipy.optimize import linear_sum_assignment

    dist = torch.cdist(theta.double().cpu(), theta_star.double().cpu())  # [k̂, k]
    k_hat, k = dist.shape
    if k_hat < k:
        closest = dist.argmin(0)
        return float(dist.min(0).values.max()), tuple(int(i) for i in closest)
    values = torch.unique(dist)  # sorted ascending
    lo, hi = 0, len(values) - 1  # the answer is one of the pairwise distances
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        blocked = (dist > values[mid]).double().numpy()  # cost 1 for edges above the threshold
        rows, cols = linear_sum_assignment(blocked.T)  # true cluster j → model
        if blocked.T[rows, cols].sum() == 0:
            best, hi = (float(values[mid]), tuple(int(c) for c in cols)), mid - 1
        else:
            lo = mid + 1
    assert best is not None  # the largest distance always admits a full matching
    return best
