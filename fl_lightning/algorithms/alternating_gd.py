"""Federated alternating GD for low-rank MF in the style of Ward & Kolda 2023 (spec 003 §2.4, baseline).

Init and step as the paper's released code (spec 003 §2.4 [code]): μ = 0.5, C = 8, η = 9/(4Cμσ_max(S)),
D = Cμ/9, U₀ = SΦ_U/(√η σ_max C), V₀ = √η σ_max D Φ_V with Φ_V ~ N(0, 1/r²), Φ_U ~ N(0, 1/d²) (shared seeds).
Every iteration each client does Uⁱ ← Uⁱ − η(UⁱVᵀ − Sⁱ)V and uploads gⁱ = (UⁱVᵀ − Sⁱ)ᵀUⁱ (with the new
Uⁱ); the server sets V ← V − η Σᵢ gⁱ: one communication per iteration.

σ_max(S) is not known to the server: the first ``sigma_rounds`` rounds run a federated power iteration
on SᵀS (every client uploads its d-vector SⁱᵀSⁱv; the server sums them). The reproduction (like the paper's
code) uses the exact σ_max and counts only the alternating iterations as communications.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import LoopClient, Params, make_generator
from fl_lightning.errors import ConfigError


def wk_constants(sigma_max: float, mu: float = 0.5, c: float = 8.0) -> tuple[float, float]:
    """(η, D) of the code's AlternateGD."""
    return 9.0 / (4.0 * c * mu * sigma_max), c * mu / 9.0


def wk_iteration(s: Tensor, u: Tensor, v: Tensor, eta: float) -> tuple[Tensor, Tensor]:
    """A client's half of one alternating step: returns (new U, gradient share (UVᵀ − S)ᵀU)."""
    u = u - eta * (u @ v.T - s) @ v
    return u, (u @ v.T - s).T @ u


class AlternatingGD(Algorithm):
    """Ward–Kolda alternating GD, federated. Model: ``fl_lightning.models.LowRankFactors``."""

    personal = ("U",)
    reveals = "S_iᵀS_i v in the σ_max rounds, then each iteration's gradient share (U_iVᵀ − S_i)ᵀU_i, computed with U_i"
    state_dependent_uploads = ("grad_V",)
    supports_frozen = False  # closed-form steps on U and V

    def __init__(self, mu: float = 0.5, c: float = 8.0, sigma_rounds: int = 30, seed: int = 0) -> None:
        super().__init__()
        if sigma_rounds < 1:
            raise ConfigError(f"AlternatingGD: sigma_rounds must be ≥ 1, got {sigma_rounds}")
        self.mu, self.c, self.sigma_rounds, self.seed = mu, c, sigma_rounds, seed

    def setup(self, global_params: Params, num_clients: int) -> None:
        d, r = global_params["V"].shape
        dtype = global_params["V"].dtype
        self.num_clients = num_clients
        g = make_generator(self.seed, "wk-init")
        self.register_buffer("phi_u", torch.randn(d, r, generator=g, dtype=dtype) / d)
        self.register_buffer("phi_v", torch.randn(d, r, generator=g, dtype=dtype) / r)
        vec = torch.randn(d, generator=g, dtype=dtype)
        self.register_buffer("power_vec", vec / vec.norm())
        self.register_buffer("sigma", torch.zeros((), dtype=torch.float64))
        self.register_buffer("eta", torch.zeros((), dtype=torch.float64))

    def init_client_state(self, global_params: Params) -> Params:
        return {"U": torch.zeros_like(global_params["U"])}

    def upload_template(self, global_params: Params) -> Params:
        return {"power": self.power_vec, "grad_V": global_params["V"]}

    def download_template(self, global_params: Params) -> Params:
        return {"V": global_params["V"]}

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        v = global_params["V"]
        s, n = ctx.y.to(v.dtype), ctx.num_samples
        zeros = {"power": torch.zeros_like(self.power_vec), "grad_V": torch.zeros_like(v)}
        if ctx.round < self.sigma_rounds:
            return ClientUpdate({**zeros, "power": s.T @ (s @ self.power_vec)}, dict(state), 1)
        eta, sigma = float(self.eta), float(self.sigma)
        if ctx.round == self.sigma_rounds:
            u = s @ self.phi_u / (eta**0.5 * sigma * self.c)
        else:
            u = state["U"][:n]
        u, grad = wk_iteration(s, u, v, eta)
        new_u = state["U"].clone()
        new_u[:n] = u
        return ClientUpdate({**zeros, "grad_V": grad}, {"U": new_u}, 1, 0.5 * float(((s - u @ v.T) ** 2).sum()))

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if facts.round < self.sigma_rounds:
            total = averaged_extra["power"] * self.num_clients  # SᵀS v
            norm = total.norm()
            self.power_vec.copy_(total / norm)
            if facts.round == self.sigma_rounds - 1:
                sigma = float(norm) ** 0.5
                eta, dd = wk_constants(sigma, self.mu, self.c)
                self.sigma.fill_(sigma)
                self.eta.fill_(eta)
                global_params["V"].copy_(eta**0.5 * sigma * dd * self.phi_v)
            return
        global_params["V"].sub_(float(self.eta) * self.num_clients * averaged_extra["grad_V"])
