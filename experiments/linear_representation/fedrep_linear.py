"""FedRep's synthetic multi-task linear regression (spec 000 §2.2–§2.3, §3.1, §5), batched over trials and clients.

Data of ``T`` independent trials: ``x`` ``[T, n, m, d]``, ``y`` ``[T, n, m]``, ``B*`` ``[T, d, k]``,
``W*`` ``[T, n, k]`` (ground truth from ``datamodules.synthetic.linear_ground_truth``: B* = Q of a Gaussian,
rows of W* rescaled to norm √k, spec 000 A3). Clients keep the same m samples in every round (spec 000 App. A.1).

Methods: FedRep (exact head least squares, then body GD, average, QR: Algorithm 2), GD-GD / 10GD-GD (1 or 10 head
GD steps instead of the exact head, §2.3), FedSGD (one shared (B, w): spec 004's FedAvg with τ = 1 on the samples),
Local Only (ridge regression on each client's own samples). Initialisations: Method of Moments (Algorithm 2) and
projected GD on the unfactorised matrix-sensing objective (App. A.1, Tu et al. 2016 Alg. 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from datamodules.synthetic import linear_ground_truth
from experiments.linear_representation.fedavg_linear import DTYPE, distance
from fl_lightning.algorithms.linear_fedrep import orthonormalize as qr_factor


@dataclass
class Tasks:
    """``T`` trials of n clients with m samples each (train) and the ground truth."""

    x: Tensor
    y: Tensor
    b_star: Tensor
    w_star: Tensor

    @property
    def theta_star(self) -> Tensor:
        """Row i = B*w*ᵢ: ``[T, n, d]``."""
        return torch.einsum("tdk,tnk->tnd", self.b_star, self.w_star)


def make_tasks(
    trials: int, num_clients: int, samples: int, dim: int, rank: int, noise_variance: float, generator: torch.Generator
) -> Tasks:
    """x ~ N(0, I_d), y = w*ᵢᵀB*ᵀx + N(0, ``noise_variance``) (spec 000 §3.1, the noise read as a variance)."""
    truths = [linear_ground_truth(num_clients, dim, rank, generator) for _ in range(trials)]
    b_star = torch.stack([b for b, _ in truths])
    w_star = torch.stack([w for _, w in truths])
    x = torch.randn(trials, num_clients, samples, dim, generator=generator, dtype=DTYPE)
    y = torch.einsum("tnmd,tnd->tnm", x, torch.einsum("tdk,tnk->tnd", b_star, w_star))
    y = y + math.sqrt(noise_variance) * torch.randn(trials, num_clients, samples, generator=generator, dtype=DTYPE)
    return Tasks(x, y, b_star, w_star)


def top_right_singular(theta: Tensor, rank: int) -> Tensor:
    """Orthonormal d×k basis of the top-k right singular space of ``theta`` ``[T, n, d]``."""
    return torch.linalg.svd(theta, full_matrices=False).Vh[:, :rank].transpose(1, 2)


def method_of_moments_init(x: Tensor, y: Tensor, rank: int) -> Tensor:
    """B⁰ = top-k eigenvectors of (1/n)Σᵢ(1/m)Σⱼ yᵢⱼ² xᵢⱼxᵢⱼᵀ (spec 000 Algorithm 2, init)."""
    z = torch.einsum("tnm,tnmd,tnme->tde", y.square(), x, x) / (x.shape[1] * x.shape[2])
    return torch.linalg.eigh(z).eigenvectors[..., -rank:].flip(-1)


def projected_gd_init(x: Tensor, y: Tensor, rank: int, steps: int = 10, lr: float = 0.1) -> tuple[Tensor, Tensor]:
    """``steps`` rounds of projected GD on the unfactorised objective (1/2m)Σᵢ‖Xᵢθᵢ − yᵢ‖², Θ ← P_k(Θ − η∇),
    from Θ = 0 (Tu et al. 2016 Alg. 1; spec 000 App. A.1). Returns B⁰ (top-k right singular vectors of Θ)
    and the heads W⁰ = ΘB⁰ (the same rank-k Θ in factored form)."""
    m = x.shape[2]
    theta = torch.zeros(*x.shape[:2], x.shape[3], dtype=DTYPE)
    for _ in range(steps):
        grad = torch.einsum("tnmd,tnm->tnd", x, torch.einsum("tnmd,tnd->tnm", x, theta) - y) / m
        u, s, vh = torch.linalg.svd(theta - lr * grad, full_matrices=False)
        theta = (u[..., :rank] * s[:, None, :rank]) @ vh[:, :rank]
    b0 = top_right_singular(theta, rank)
    return b0, torch.einsum("tnd,tdk->tnk", theta, b0)


def random_init(trials: int, dim: int, rank: int, generator: torch.Generator) -> Tensor:
    """B⁰ = Q factor of a Gaussian d×k matrix."""
    return torch.linalg.qr(torch.randn(trials, dim, rank, generator=generator, dtype=DTYPE)).Q


def function_value(b: Tensor, w: Tensor, b_star: Tensor, w_star: Tensor) -> Tensor:
    """F(W, B) = (1/2n)Σᵢ‖Bwᵢ − B*w*ᵢ‖² (spec 000 §5, population form), per trial."""
    diff = torch.einsum("tdk,tnk->tnd", b, w) - torch.einsum("tdk,tnk->tnd", b_star, w_star)
    return 0.5 * diff.square().sum(-1).mean(-1)


@dataclass
class FedRepRun:
    """``dist`` and ``fvalue`` are ``[rounds + 1, T]`` (row 0 = initialisation); ``b`` ``[T, d, k]``,
    ``w`` ``[T, n, k]``."""

    dist: Tensor
    fvalue: Tensor
    b: Tensor
    w: Tensor


def fit_heads(feats: Tensor, y: Tensor, ridge: float = 0.0) -> Tensor:
    """argmin_w ‖F w − y‖² (+ ridge‖w‖²) per client: ``feats`` ``[..., m, k]``, ``y`` ``[..., m]``.

    Normal equations (FᵀF + λI)w = Fᵀy, batched; without ridge and with m < k, the minimum-norm least squares.
    """
    m, k = feats.shape[-2:]
    if ridge == 0.0 and m < k:
        return torch.linalg.lstsq(feats, y[..., None]).solution[..., 0]
    gram = feats.transpose(-1, -2) @ feats
    if ridge:
        gram = gram + ridge * torch.eye(k, dtype=feats.dtype)
    return torch.linalg.solve(gram, feats.transpose(-1, -2) @ y[..., None])[..., 0]


def fedrep(
    tasks: Tasks,
    b0: Tensor,
    w0: Tensor,
    rounds: int,
    body_lr: float,
    head_steps: int | None = None,
    head_lr: float = 0.1,
    clients_per_round: int | None = None,
    orthonormalize: bool = True,
    generator: torch.Generator | None = None,
    cohorts: Callable[[int], Tensor] | None = None,
    track_fvalue: bool = True,
    positive_qr: bool = True,
) -> FedRepRun:
    """FedRep (``head_steps=None``: exact least-squares heads) or GD-GD / 10GD-GD (``head_steps`` head GD steps).

    Per round (spec 000 Algorithm 2 with fixed samples): each sampled client fits its head on B, takes one GD
    step on B with the new head fixed, ∇_B f̂ᵢ = (1/m)Σⱼ(xⱼᵀBwᵢ − yⱼ)xⱼwᵢᵀ; the server averages the Bᵢ and
    (if ``orthonormalize``) keeps the Q factor, with a positive-diagonal R unless ``positive_qr`` is false (the
    engine's ``LinearFedRep`` convention and its QR function). Heads of unsampled clients are unchanged. Each round
    ``clients_per_round`` clients are drawn per trial from ``generator``, or ``cohorts(t)`` (the same indices for
    every trial, e.g. the engine's ``ClientSampler.sample``) when given. ``fvalue`` is empty unless ``track_fvalue``.
    """
    x, y = tasks.x, tasks.y
    trials, n, m, _ = x.shape
    s = n if clients_per_round is None else clients_per_round
    b, w = b0.to(DTYPE).clone(), w0.to(DTYPE).expand(trials, n, -1).clone()
    rows = torch.arange(trials)[:, None]
    dists, fvals = [distance(tasks.b_star, b)], [function_value(b, w, tasks.b_star, tasks.w_star)]
    for t in range(rounds):
        if cohorts is None and s == n:
            idx, xs, ys, ws = None, x, y, w
        else:
            if cohorts is not None:
                idx = torch.as_tensor(cohorts(t)).long().expand(trials, -1)
            else:
                idx = torch.rand(trials, n, generator=generator).topk(s, dim=1).indices
            xs, ys, ws = x[rows, idx], y[rows, idx], w[rows, idx]
        feats = torch.einsum("tsmd,tdk->tsmk", xs, b)
        if head_steps is None:
            ws = fit_heads(feats, ys)
        else:
            for _ in range(head_steps):
                ws = (
                    ws
                    - head_lr * torch.einsum("tsmk,tsm->tsk", feats, torch.einsum("tsmk,tsk->tsm", feats, ws) - ys) / m
                )
        residual = torch.einsum("tsmk,tsk->tsm", feats, ws) - ys
        grad = torch.einsum("tsmd,tsm,tsk->tsdk", xs, residual, ws) / m
        b = (b[:, None] - body_lr * grad).mean(1)
        if orthonormalize:
            b = qr_factor(b, positive_qr)
        if idx is None:
            w = ws
        else:
            w = w.clone()
            w[rows, idx] = ws
        dists.append(distance(tasks.b_star, b))
        if track_fvalue:
            fvals.append(function_value(b, w, tasks.b_star, tasks.w_star))
    return FedRepRun(torch.stack(dists), torch.stack(fvals) if track_fvalue else torch.empty(0), b, w)


def local_only(x: Tensor, y: Tensor, ridge: float = 1e-5) -> Tensor:
    """Each client's own d-dimensional ridge regressor θᵢ = (XᵢᵀXᵢ + λI)⁻¹Xᵢᵀyᵢ (spec 000 §2.3): ``[..., d]``."""
    return fit_heads(x, y, ridge)


def squared_error(theta: Tensor, theta_star: Tensor) -> Tensor:
    """Population test MSE E_x[(⟨θ − θ*, x⟩)²] = ‖θ − θ*‖² for x ~ N(0, I_d) and noise-free test labels."""
    return (theta - theta_star).square().sum(-1)


def new_clients(
    b_star: Tensor, m_new: int, num_new: int, noise_variance: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """``num_new`` new clients per trial: heads w* ~ N(0, I_k), ``m_new`` noisy samples; returns (x, y, θ*)."""
    trials, d, k = b_star.shape
    theta = torch.einsum("tdk,tnk->tnd", b_star, torch.randn(trials, num_new, k, generator=generator, dtype=DTYPE))
    x = torch.randn(trials, num_new, m_new, d, generator=generator, dtype=DTYPE)
    y = torch.einsum("tnmd,tnd->tnm", x, theta)
    y = y + math.sqrt(noise_variance) * torch.randn(trials, num_new, m_new, generator=generator, dtype=DTYPE)
    return x, y, theta


def head_on_representation_error(b: Tensor, x: Tensor, y: Tensor, theta_star: Tensor, ridge: float = 1e-5) -> Tensor:
    """‖Bŵᵢ − θᵢ*‖² per new client ``[T, N]``, ŵᵢ the ridge head fitted on the fixed B (spec 000 §5 new-client MSE)."""
    w = fit_heads(torch.einsum("tnmd,tdk->tnmk", x, b), y, ridge)
    return squared_error(torch.einsum("tdk,tnk->tnd", b, w), theta_star)
