"""FedRep for multi-task linear regression (spec 000 Algorithm 2) and its GD-GD / 10GD-GD variants (§2.3).

Model ``y = wᵢᵀ Bᵀ x`` (``fl_lightning.models.LinearRepresentation``: ``body.weight`` is Bᵀ, k×d;
``head.weight`` is wᵢᵀ, 1×k). On its loss fᵢ a client

1. fits its head: exactly, ``wᵢ = argmin_w fᵢ(B, w)`` (least squares), or by ``head_steps`` GD steps of size
   ``head_lr`` from its stored head (GD-GD: 1 step, 10GD-GD: 10 steps);
2. takes ``body_steps`` GD steps of size ``body_lr`` on B with the head fixed, ∇_B fᵢ = e wᵢᵀ.

``gradient: samples`` uses the client's m samples, fᵢ = (1/2m)Σⱼ(wᵀBᵀxⱼ − yⱼ)², e = (1/m)Σⱼ(xⱼᵀBwᵢ − yⱼ)xⱼ;
``gradient: population`` the expected loss fᵢ = ½‖Bw − θᵢ*‖² (x ~ N(0, I_d), θᵢ* from the data module's
``population_target``), e = Bw − θᵢ*.

The server averages the Bᵢ and, if ``orthonormalize``, replaces B by the Q factor of its QR decomposition. Conventions
(options, with their defaults):

* ``positive_qr: true``: the QR factor is taken with a positive-diagonal R (Q's column j is multiplied by
  sign(R_jj)), the unique QR with that property. Without it LAPACK may flip a column of B from one round to
  the next, which negates that coordinate for the stored heads of every client not sampled in the round.
* ``head_init: zeros``: personal heads start at 0 (the spec 000 [CHECK] run and the papers' theory);
  ``shared_random`` starts every client's head at the network's initial head (one shared random vector).
  Irrelevant for the exact head solver.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.algorithms.linear_fedavg import Gradient, population_targets
from fl_lightning.client import LoopClient, Params
from fl_lightning.errors import ConfigError


def orthonormalize(b: Tensor, positive: bool = True) -> Tensor:
    """Q of B = QR (B: [..., d, k]); with ``positive`` the Q whose R has a positive diagonal."""
    q, r = torch.linalg.qr(b)
    if not positive:
        return q
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    return q * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2)


class LinearFedRep(Algorithm):
    personal = ("head.",)
    supports_frozen = False  # closed-form steps on B and w

    def __init__(
        self,
        body_lr: float = 0.1,
        body_steps: int = 1,
        head_solver: Literal["exact", "gd"] = "exact",
        head_steps: int = 1,
        head_lr: float = 0.1,
        orthonormalize: bool = True,
        positive_qr: bool = True,
        head_init: Literal["zeros", "shared_random"] = "zeros",
        gradient: Gradient = "samples",
    ) -> None:
        super().__init__()
        if body_lr <= 0 or head_lr <= 0 or body_steps < 0 or head_steps < 1:
            raise ConfigError(
                f"LinearFedRep: need body_lr, head_lr > 0, body_steps ≥ 0, head_steps ≥ 1, "
                f"got {body_lr}, {head_lr}, {body_steps}, {head_steps}"
            )
        if head_solver not in ("exact", "gd") or head_init not in ("zeros", "shared_random"):
            raise ConfigError(f"LinearFedRep: unknown head_solver {head_solver!r} or head_init {head_init!r}")
        if gradient not in ("samples", "population"):
            raise ConfigError(f"LinearFedRep: gradient must be 'samples' or 'population', got {gradient!r}")
        self.body_lr, self.body_steps = body_lr, body_steps
        self.head_solver, self.head_steps, self.head_lr = head_solver, head_steps, head_lr
        self.orthonormalize, self.positive_qr, self.head_init = orthonormalize, positive_qr, head_init
        self.gradient = gradient
        self.targets: Tensor | None = None

    def bind_ground_truth(self, extras: dict[str, Tensor]) -> None:
        self.targets = population_targets(extras, self.gradient, "LinearFedRep")

    def init_client_state(self, global_params: Params) -> Params:
        head = global_params["head.weight"]
        return {"head.weight": torch.zeros_like(head) if self.head_init == "zeros" else head}

    @property
    def reveals(self) -> str:  # type: ignore[override]
        if self.head_solver == "exact":
            return "B after GD steps with the client's least-squares head (a function of its data and B; never sent)"
        return "B after GD steps with the client's head, which starts from its personal head (never sent)"

    @property
    def state_dependent_uploads(self) -> tuple[str, ...]:  # type: ignore[override]
        return () if self.head_solver == "exact" else ("",)

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        bt = global_params["body.weight"].clone()  # Bᵀ, k×d
        w = state["head.weight"].reshape(-1).clone().to(bt)  # k
        x, y, m = ctx.x, ctx.y, ctx.num_samples
        target = None if self.targets is None else self.targets[ctx.client].to(bt)
        if target is None:
            feats = x @ bt.T  # m×k, rows Bᵀxⱼ
            if self.head_solver == "exact":
                w = torch.linalg.lstsq(feats, y.unsqueeze(1)).solution.squeeze(1)
            else:
                for _ in range(self.head_steps):
                    w = w - self.head_lr * feats.T @ (feats @ w - y) / m
        elif self.head_solver == "exact":
            w = torch.linalg.lstsq(bt.T, target.unsqueeze(1)).solution.squeeze(1)
        else:
            for _ in range(self.head_steps):
                w = w - self.head_lr * bt @ (bt.T @ w - target)
        for _ in range(self.body_steps):
            e = bt.T @ w - target if target is not None else x.T @ (x @ bt.T @ w - y) / m  # d
            bt = bt - self.body_lr * torch.outer(w, e)  # (∇_B fᵢ)ᵀ = w eᵀ
        if target is not None:
            loss = 0.5 * float((bt.T @ w - target).square().sum())
        else:
            loss = 0.5 * float(((x @ bt.T @ w - y) ** 2).mean())
        return ClientUpdate(
            upload={"body.weight": bt},
            state={"head.weight": w.reshape(1, -1)},
            num_samples=m,
            loss=loss,
        )

    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if self.orthonormalize:
            q = orthonormalize(global_params["body.weight"].T, self.positive_qr)
            global_params["body.weight"].copy_(q.T)
