"""FedAvg with τ local GD steps on head and body of the two-layer linear model (spec 004 §2.1); τ = 1 is D-GD (§2.2).

Model ``y = ⟨Bw, x⟩`` (``fl_lightning.models.LinearRepresentation``: ``body.weight`` is Bᵀ, ``head.weight`` is wᵀ).
A client takes ``local_steps`` simultaneous full-batch GD steps of size ``step_size`` on its loss fᵢ:
with e = ∇_θ fᵢ at θ = Bw, ``B ← B − α e wᵀ`` and ``w ← w − α Bᵀe``, and uploads both; with ``aggregation: uniform``
and ``server_lr: 1`` the engine's update is the plain average (spec 004: the server averages body and head,
clients are stateless).

``gradient`` chooses fᵢ:

* ``samples``: the empirical loss (1/2n)Σⱼ(⟨Bw, xⱼ⟩ − yⱼ)², e = (1/n)Σⱼ(⟨Bw, xⱼ⟩ − yⱼ)xⱼ;
* ``population`` (spec 004 §1.1, the paper's experiments): fᵢ = ½‖Bw − θᵢ*‖², e = Bw − θᵢ*, the expected loss for
  x ~ N(0, I_d) up to the noise constant. θᵢ* = E[x y] of client i comes from the data module's
  ``population_target`` (``SyntheticLinearDataModule``); it is read inside client i's update only.

``init: spec004`` replaces the network's initial values by spec 004 §2.5's B₀ = Q/√α (Q = the network's
orthonormalised B) and w₀ = 0 before the first round.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import LoopClient, Params
from fl_lightning.errors import ConfigError

Gradient = Literal["samples", "population"]


def population_targets(extras: dict[str, Tensor], gradient: Gradient, owner: str) -> Tensor | None:
    """The clients' θᵢ* rows for ``gradient: population`` (``None`` for samples); one-line error if missing."""
    if gradient not in ("samples", "population"):
        raise ConfigError(f"{owner}: gradient must be 'samples' or 'population', got {gradient!r}")
    if gradient == "samples":
        return None
    if "population_target" not in extras:
        raise ConfigError(
            f"{owner}: gradient 'population' needs a data module with per-client population targets "
            "(extras['population_target'], e.g. datamodules.SyntheticLinearDataModule)"
        )
    return extras["population_target"]


class LinearFedAvg(Algorithm):
    reveals = "B and w after local GD steps on the client's data (or its population loss); no client state exists"
    supports_frozen = False  # closed-form GD on body and head

    def __init__(
        self,
        local_steps: int = 2,
        step_size: float = 0.4,
        init: Literal["spec004", "model"] = "spec004",
        gradient: Gradient = "samples",
    ):
        super().__init__()
        if local_steps < 1 or step_size <= 0:
            raise ConfigError(f"LinearFedAvg: need local_steps ≥ 1 and step_size > 0, got {local_steps}, {step_size}")
        if gradient not in ("samples", "population"):
            raise ConfigError(f"LinearFedAvg: gradient must be 'samples' or 'population', got {gradient!r}")
        self.local_steps, self.step_size, self.init, self.gradient = local_steps, step_size, init, gradient
        self.targets: Tensor | None = None

    def bind_ground_truth(self, extras: dict[str, Tensor]) -> None:
        self.targets = population_targets(extras, self.gradient, "LinearFedAvg")

    def setup(self, global_params: Params, num_clients: int) -> None:
        if self.init == "spec004":  # computed in float64, stored in the parameters' dtype
            with torch.no_grad():
                q, _ = torch.linalg.qr(global_params["body.weight"].T.double())
                global_params["body.weight"].copy_(q.T / self.step_size**0.5)
                global_params["head.weight"].zero_()

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        bt, w = global_params["body.weight"].clone(), global_params["head.weight"].reshape(-1).clone()  # Bᵀ: k×d
        x, y, n = ctx.x, ctx.y, ctx.num_samples
        if self.targets is not None:
            target = self.targets[ctx.client].to(bt)

            def residual(theta: Tensor) -> Tensor:
                return theta - target
        else:

            def residual(theta: Tensor) -> Tensor:
                return x.T @ (x @ theta - y) / n

        for _ in range(self.local_steps):
            e = residual(bt.T @ w)  # d
            bt, w = bt - self.step_size * torch.outer(w, e), w - self.step_size * bt @ e
        if self.targets is not None:
            loss = 0.5 * float((bt.T @ w - target).square().sum())
        else:
            loss = 0.5 * float(((x @ (bt.T @ w) - y) ** 2).mean())
        return ClientUpdate(
            upload={"body.weight": bt, "head.weight": w.reshape(1, -1)}, state={}, num_samples=n, loss=loss
        )
