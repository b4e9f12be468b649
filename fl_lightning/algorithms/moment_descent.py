"""Federated Moment Descent on anchor clients (spec 001 §2.1–2.2, Phase 1), then FedX+clustering (Phase 2).

Rounds (all clients take part, reusing their data: the experiments' simplifications, spec 001 §3.2):

* round 0, registration: clients report whether they may be anchors (nᵢ ≥ ``anchor_min_samples``); the
  server draws ``num_anchors`` of them (default ⌈3k ln k⌉) and gives every anchor the common start θ₀
  (the network's first initial row);
* per Phase-1 iteration t (``phase1_iters`` of them):
  - subspace: each client forms, for every anchor model θ_h, the residual vectors e(x, y, θ_h) = (y − xᵀθ_h)x
    of its points and sums e(a) e(b)ᵀ over point pairs a ≠ b (``pairing``); the server gets the top-k left
    singular vectors Û_h of Y_h = Σ a bᵀ either by direct SVD of the aggregated Y_h (``subspace: svd``, one
    round) or by federated orthogonal iteration, Algorithm 3 (``subspace: orthogonal``, ``orth_iters`` rounds);
  - anchor step: anchor h forms A = (1/ℓ) Σ (Ûᵀe(a))(Ûᵀe(b))ᵀ over its pairs (eq. (2)), gets (β̂, σ̂²) from
    ``power_iters`` power iterations on AAᵀ (0 = exact SVD), orients β̂ along Σ e (spec 001 §2.1 sign
    suggestion) and, if σ̂ > εΔ, moves θ_h ← θ_h + (α/(2β²)) σ̂ Ûβ̂ (``step_scale`` = α/(2β²) = ½ for
    isotropic features);
* after the last iteration, anchors within Δ/2 are grouped (single linkage); if that does not give k
  groups, or Δ is not given, single linkage is cut at k groups. The group means are θ̂, written into
  the network's ``theta``; Phase 2 (``IFCA``) runs from there.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate, RoundFacts
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.client import LoopClient, Params, make_generator
from fl_lightning.errors import ConfigError

Pairing = Literal["all", "disjoint"]


def residuals(x: Tensor, y: Tensor, models: Tensor) -> Tensor:
    """e(x, y, θ) = (y − xᵀθ) x for every model: x [n, d], y [n], models [H, d] → [H, n, d]."""
    return (y - models @ x.T).unsqueeze(-1) * x


def split_pairs(e: Tensor) -> tuple[Tensor, Tensor]:
    """The ⌊n/2⌋ disjoint pairs (points 2j, 2j+1) of residual vectors e [..., n, d]."""
    m = e.shape[-2] // 2
    return e[..., 0 : 2 * m : 2, :], e[..., 1 : 2 * m : 2, :]


def pair_moment(x: Tensor, y: Tensor, models: Tensor, pairing: Pairing = "all") -> Tensor:
    """A client's share of Y_{h,t} (spec 001 step 9) for every model: [H, d, d].

    ``disjoint``: Σ over the pairs (2j, 2j+1) of e(a) e(b)ᵀ. ``all``: Σ over all ordered pairs a ≠ b of the
    client's points, (Σe)(Σe)ᵀ − Σ e eᵀ: the same expectation (points of one client are independent
    given its label), lower variance.
    """
    e = residuals(x, y, models)
    if pairing == "disjoint":
        a, b = split_pairs(e)
        return a.transpose(-1, -2) @ b
    total = e.sum(-2)
    return total.unsqueeze(-1) * total.unsqueeze(-2) - e.transpose(-1, -2) @ e


def pair_products(x: Tensor, y: Tensor, models: Tensor, q: Tensor, transpose: bool, pairing: Pairing = "all") -> Tensor:
    """Algorithm 3 steps 5/8 without forming d×d: Σ b aᵀ Q (``transpose``) or Σ a bᵀ Q → [H, d, k]."""
    e = residuals(x, y, models)
    if pairing == "all":  # symmetric: transpose does not matter
        total = e.sum(-2)
        return total.unsqueeze(-1) * (total.unsqueeze(-2) @ q) - e.transpose(-1, -2) @ (e @ q)
    a, b = split_pairs(e)
    if transpose:
        a, b = b, a
    return a.transpose(-1, -2) @ (b @ q)


def top_subspace(moment: Tensor, k: int) -> Tensor:
    """Top-k left singular vectors of each Y_h: [H, d, d] → [H, d, k] (the experiments' direct SVD)."""
    u, _, _ = torch.linalg.svd(moment)
    return u[..., :k]


def orthonormalize(q: Tensor) -> Tensor:
    return torch.linalg.qr(q)[0]


def anchor_step(
    x: Tensor,
    y: Tensor,
    theta: Tensor,
    basis: Tensor,
    power_iters: int = 0,
    step_scale: float = 0.5,
    threshold: float = 0.0,
    pairing: Pairing = "all",
) -> tuple[Tensor, float]:
    """One FedMD update of one anchor (spec 001 §2.1 steps 11–15): returns (θ_{t+1}, σ̂).

    A = mean over the anchor's point pairs of (Ûᵀe(a))(Ûᵀe(b))ᵀ (eq. (2)); σ̂² = σ₁(A), β̂ its top left
    singular vector (exact SVD, or ``power_iters`` power iterations on AAᵀ)."""
    e = residuals(x, y, theta[None])[0]
    if pairing == "disjoint":
        a, b = split_pairs(e)
        pa, pb = a @ basis, b @ basis  # [ℓ, k]
        amat = pa.T @ pb / max(a.shape[0], 1)
    else:
        p, n = e @ basis, e.shape[0]
        total = p.sum(0)
        amat = (torch.outer(total, total) - p.T @ p) / max(n * (n - 1), 1)
    if power_iters > 0:
        gram = amat @ amat.T
        beta = torch.ones(amat.shape[0], dtype=amat.dtype) / amat.shape[0] ** 0.5
        for _ in range(power_iters):
            beta = gram @ beta
            beta = beta / beta.norm().clamp(min=1e-300)
        top = abs(float(beta @ gram @ beta)) ** 0.5  # σ_1(A)
    else:
        u, s, _ = torch.linalg.svd(amat)
        beta, top = u[:, 0], float(s[0])
    sigma = top**0.5
    direction = basis @ beta
    if float(direction @ e.sum(0)) < 0:
        direction = -direction
    if sigma <= threshold:
        return theta, sigma
    return theta + step_scale * sigma * direction, sigma


def group_anchors(models: Tensor, k: int, delta: float | None = None) -> tuple[Tensor, Tensor]:
    """Spec 001 step 16: anchors closer than Δ/2 form a group (single linkage); if that does not give k
    groups (or Δ is None), single linkage cut at k groups. Returns (labels [H], centres [k, d])."""
    pts = models.double().cpu().numpy()
    if len(pts) == 1:
        labels = np.zeros(1, dtype=int)
    else:
        tree = linkage(pts, method="single")
        labels = fcluster(tree, t=delta / 2, criterion="distance") - 1 if delta is not None else None
        if labels is None or labels.max() + 1 != k:
            labels = fcluster(tree, t=k, criterion="maxclust") - 1
    lab = torch.as_tensor(labels, dtype=torch.long)
    centres = torch.zeros(k, models.shape[1], dtype=models.dtype)
    for j in range(k):
        members = models[lab == j]
        centres[j] = members.mean(0) if len(members) else models[j % len(models)]
    return lab, centres


def default_num_anchors(k: int) -> int:
    """⌈3k ln k⌉ (spec 001 §3.2, natural log: 10 anchors for k = 3)."""
    return max(1, math.ceil(3 * k * math.log(k))) if k > 1 else 1


class FedMD(IFCA):
    reveals = (
        "round 0: whether n_i ≥ anchor_min_samples (the client's own entry); subspace rounds: its residual "
        "pair moments; anchor rounds: an anchor's updated model; then as IFCA (its cluster)"
    )

    """FedMD (Phase 1) + FedX+clustering (Phase 2) of spec 001. See the module docstring for the rounds.

    Args:
        num_anchors: n_H (default ⌈3k ln k⌉).
        phase1_iters: T, Phase-1 iterations (the experiments: 5).
        subspace: ``svd`` (direct SVD of the aggregated Y_h) or ``orthogonal`` (Algorithm 3).
        orth_iters: T₁ rounds of Algorithm 3 per iteration (even).
        power_iters: T₂ power iterations on AAᵀ (0: exact SVD of the k×k matrix A).
        step_scale: α/(2β²) of the step η = α σ̂ /(2β²).
        epsilon, delta: the stop test σ̂ > εΔ and the Δ/2 grouping threshold (Δ None: no test, cut at k).
        anchor_min_samples: clients with at least this many points may be anchors.
        pairing: which point pairs of a client enter Y and A: ``all`` ordered pairs a ≠ b (default) or the
            ⌊nᵢ/2⌋ ``disjoint`` pairs (spec 001 §9's suggestion).
        seed: anchor draw and Algorithm 3's random starts.
        local_steps, lr, solver: Phase 2 (``IFCA``).
    """

    def __init__(
        self,
        num_anchors: int | None = None,
        phase1_iters: int = 5,
        subspace: Literal["svd", "orthogonal"] = "svd",
        orth_iters: int = 10,
        power_iters: int = 0,
        step_scale: float = 0.5,
        epsilon: float = 0.0,
        delta: float | None = None,
        anchor_min_samples: int = 20,
        pairing: Pairing = "all",
        seed: int = 0,
        local_steps: int = 5,
        lr: float = 0.05,
        solver: Literal["gd", "prox"] = "gd",
    ) -> None:
        super().__init__(local_steps, lr, solver)
        if subspace not in ("svd", "orthogonal"):
            raise ConfigError(f"FedMD: subspace must be 'svd' or 'orthogonal', got {subspace!r}")
        if subspace == "orthogonal" and (orth_iters < 2 or orth_iters % 2):
            raise ConfigError(f"FedMD: orth_iters must be even and ≥ 2 (Algorithm 3), got {orth_iters}")
        if phase1_iters < 1:
            raise ConfigError(f"FedMD: phase1_iters must be ≥ 1, got {phase1_iters}")
        self.num_anchors, self.phase1_iters, self.subspace = num_anchors, phase1_iters, subspace
        self.orth_iters, self.power_iters, self.step_scale = orth_iters, power_iters, step_scale
        self.epsilon, self.delta, self.anchor_min_samples, self.seed = epsilon, delta, anchor_min_samples, seed
        if pairing not in ("all", "disjoint"):
            raise ConfigError(f"FedMD: pairing must be 'all' or 'disjoint', got {pairing!r}")
        self.pairing = pairing
        self.sub_rounds = (1 if subspace == "svd" else orth_iters) + 1
        self.warmup_rounds = 1 + phase1_iters * self.sub_rounds

    def setup(self, global_params: Params, num_clients: int) -> None:
        k, d = global_params["theta"].shape
        self.k, self.num_clients = k, num_clients
        h = self.num_anchors or default_num_anchors(k)
        if h > num_clients:
            raise ConfigError(f"FedMD: num_anchors={h} is more than the {num_clients} clients")
        self.h = h
        dtype = global_params["theta"].dtype
        self.register_buffer("anchor_ids", torch.full((h,), -1, dtype=torch.long))
        self.register_buffer("anchor_models", global_params["theta"][0].detach().clone().repeat(h, 1))
        self.register_buffer("basis", torch.zeros(h, d, k, dtype=dtype))
        self.register_buffer("anchor_labels", torch.full((h,), -1, dtype=torch.long))

    # -- schedule ---------------------------------------------------------------------------------------
    def phase(self, round_idx: int) -> tuple[str, int, int]:
        """(kind, iteration t, sub-round s): kind ∈ {register, subspace, anchor, fedx}."""
        if round_idx == 0:
            return "register", 0, 0
        if round_idx >= self.warmup_rounds:
            return "fedx", 0, 0
        t, s = divmod(round_idx - 1, self.sub_rounds)
        return ("anchor" if s == self.sub_rounds - 1 else "subspace"), t, s

    def random_start(self, t: int, d: int, dtype: torch.dtype) -> Tensor:
        """Q₀ of Algorithm 3 for iteration t (one random orthonormal d×k matrix per anchor)."""
        g = make_generator(self.seed, "fedmd-q0", t)
        return orthonormalize(torch.randn(self.h, d, self.k, generator=g, dtype=dtype))

    def extra_uploads(self, global_params: Params) -> Params:
        theta = global_params["theta"]
        d, dtype = theta.shape[1], theta.dtype
        width = d if self.subspace == "svd" else self.k
        return {
            "eligible": torch.zeros(self.num_clients, dtype=dtype),
            "moment": torch.zeros(self.h, d, width, dtype=dtype),
            "anchor_sum": torch.zeros(self.h, d, dtype=dtype),
            "anchor_mask": torch.zeros(self.h, dtype=dtype),
        }

    # -- client side of Phase 1 -------------------------------------------------------------------------
    def warmup_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        kind, t, s = self.phase(ctx.round)
        theta = global_params["theta"]
        x, y = ctx.x.to(theta.dtype), ctx.y.to(theta.dtype)
        n = ctx.num_samples
        if kind == "register":
            eligible = torch.zeros(self.num_clients, dtype=theta.dtype)
            eligible[ctx.client] = float(n >= self.anchor_min_samples)
            upload = {"eligible": eligible}
        elif kind == "subspace":
            if self.subspace == "svd":
                share = pair_moment(x, y, self.anchor_models, self.pairing)
            else:
                q = self.random_start(t, theta.shape[1], theta.dtype) if s == 0 else self.basis
                share = pair_products(x, y, self.anchor_models, q, s % 2 == 0, self.pairing)
            upload = {"moment": share / n}
        else:
            models, mask = torch.zeros_like(self.anchor_models), torch.zeros(self.h, dtype=theta.dtype)
            for h in (self.anchor_ids == ctx.client).nonzero().flatten().tolist():
                models[h], _ = anchor_step(
                    x,
                    y,
                    self.anchor_models[h],
                    self.basis[h],
                    self.power_iters,
                    self.step_scale,
                    self.threshold,
                    self.pairing,
                )
                mask[h] = 1.0
            upload = {"anchor_sum": models, "anchor_mask": mask}
        return ClientUpdate(self.complete(upload, global_params), dict(state), n, 0.0)

    @property
    def threshold(self) -> float:
        return self.epsilon * self.delta if self.delta is not None else 0.0

    # -- server side of Phase 1 -------------------------------------------------------------------------
    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if facts.round >= self.warmup_rounds:
            return
        kind, t, s = self.phase(facts.round)
        if kind == "register":
            candidates = (averaged_extra["eligible"] > 0).nonzero().flatten()
            if len(candidates) < self.h:
                raise ConfigError(
                    f"FedMD: only {len(candidates)} clients have ≥ {self.anchor_min_samples} samples, "
                    f"{self.h} anchors needed"
                )
            perm = torch.randperm(len(candidates), generator=make_generator(self.seed, "fedmd-anchors"))
            self.anchor_ids.copy_(candidates[perm[: self.h]].sort().values)
        elif kind == "subspace":
            agg = averaged_extra["moment"]
            if self.subspace == "svd":
                self.basis.copy_(top_subspace(agg, self.k))
            elif s % 2 == 0:
                self.basis.copy_(agg)  # Y^T Q (step 6)
            else:
                self.basis.copy_(orthonormalize(agg))  # QR of Y Y^T Q (step 9)
        else:
            mask = averaged_extra["anchor_mask"]
            seen = mask > 0
            self.anchor_models[seen] = averaged_extra["anchor_sum"][seen] / mask[seen].unsqueeze(-1)
            if t == self.phase1_iters - 1:
                labels, centres = group_anchors(self.anchor_models, self.k, self.delta)
                self.anchor_labels.copy_(labels)
                global_params["theta"].copy_(centres.to(global_params["theta"].dtype))
