"""Federated low-rank matrix factorisation: power initialisation + local GD on Uⁱ (spec 003 §2.1–2.3).

min ½ Σᵢ ‖Sⁱ − UⁱVᵀ‖²_F with V (d×r) shared and Uⁱ (nᵢ×r) private.

* Algorithm 1 (rounds 0..α): V = (SᵀS)^α SᵀΦ as sums of the clients' d×r products — round 0
  sums SⁱᵀΦⁱ (Φⁱ Gaussian, drawn locally), round a sums SⁱᵀSⁱV; no normalisation in between. With
  ``sketches = m`` every round carries m candidates and the server keeps the one with the smallest
  κ(V) = σ₁(V)/σ_{rank}(V) (the best-of-m "restart strategy", Thm 2).
* Algorithm 2 (rounds ≥ α+1, no communication): each client runs GD on Uⁱ with γ = 1/σ_max²(V) from
  Uⁱ₀ ~ N(0, 1/nᵢ), optionally with Nesterov momentum β_k = k/(k+3) (spec 003 §2.3), ``local_steps``
  iterations per engine round. The engine still runs its (empty) aggregation in those rounds; the
  method's communications are the α+1 rounds of Algorithm 1.

The server sums the uploads itself, so it sees every client's sketch SⁱᵀΦⁱ and SⁱᵀSⁱV: the paper assumes secure
aggregation (spec 003 §2.1), which this engine does not implement.

Uploads are sums, so every client reports weight 1 and the server multiplies the average by the
number of clients: all clients must take part in every round (``participation: 1.0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import LoopClient, Params
from fl_lightning.errors import ConfigError


def power_products(s: Tensor, v: Tensor) -> Tensor:
    """One client's share SⁱᵀSⁱV of a power step, right to left (never d×d): v [..., d, r] → [..., d, r]."""
    return s.T @ (s @ v)


def condition_number(v: Tensor, rank: int | None = None) -> float:
    """κ(V) = σ₁(V)/σ_rank(V) (rank defaults to r; spec 003 §6 item 4)."""
    sv = torch.linalg.svdvals(v)
    return float(sv[0] / sv[(rank or v.shape[-1]) - 1])


def step_size(v: Tensor) -> float:
    """γ = 1/L, L = σ_max²(V) (Property 1)."""
    return 1.0 / float(torch.linalg.matrix_norm(v, ord=2)) ** 2


def local_gd(
    s: Tensor, v: Tensor, u: Tensor, y: Tensor, steps: int, start: int = 0, nesterov: bool = False, record: int = 1
) -> tuple[Tensor, Tensor, list[float]]:
    """``steps`` iterations of Algorithm 2 on U from iteration ``start``: returns (U, Y, F after every
    ``record``-th step and after the last).

    Plain: U ← U − γ(UVᵀ − S)V. Nesterov (spec 003 §2.3): U_{k+1} = Y_k − γ∇F(Y_k),
    Y_{k+1} = U_{k+1} + k/(k+3)·(U_{k+1} − U_k). ``∇F(U) = U G − SV`` with G = VᵀV and SV precomputed.
    """
    gram, sv, gamma = v.T @ v, s @ v, step_size(v)
    losses = []
    for k in range(start, start + steps):
        point = y if nesterov else u
        new = point - gamma * (point @ gram - sv)
        y = new + (k / (k + 3)) * (new - u) if nesterov else new
        u = new
        if (k - start + 1) % record == 0 or k == start + steps - 1:
            losses.append(mf_loss(s, u, v))
    return u, y, losses


def exact_solution(s: Tensor, v: Tensor) -> Tensor:
    """Û = S V (VᵀV)† (Prop. 2)."""
    return s @ v @ torch.linalg.pinv(v.T @ v, hermitian=True)


def mf_loss(s: Tensor, u: Tensor, v: Tensor) -> float:
    """F = ½‖S − UVᵀ‖²_F (with the ½, as the paper's code plots)."""
    return 0.5 * float(((s - u @ v.T) ** 2).sum())


def optimal_loss(s: Tensor, rank: int) -> float:
    """F_min = ½ Σ_{i>r} σᵢ² (Eckart–Young; all of σ_{r+1}, … — spec 003 §4.6 code-bug note)."""
    sv = torch.linalg.svdvals(s)
    return 0.5 * float((sv[rank:] ** 2).sum())


class PowerInitLocalGD(Algorithm):
    """Spec 003's method (Algorithms 1 + 2). Model: ``fl_lightning.models.LowRankFactors``.

    Args:
        alpha: α, power iterations (α+1 communications).
        sketches: m independent Φ, keep the V with the smallest κ(V).
        local_steps: GD iterations per engine round after the initialisation.
        nesterov: momentum β_k = k/(k+3).
        kappa_rank: the σ index in κ(V) (default r).
    """

    personal = ("U",)
    reveals = "every client's d×r sketches S_iᵀΦ_i and S_iᵀS_iV (the server sums them itself; no secure sum)"
    supports_frozen = False  # closed-form power steps and GD on U, V

    def __init__(
        self,
        alpha: int = 0,
        sketches: int = 1,
        local_steps: int = 10,
        nesterov: bool = False,
        kappa_rank: int | None = None,
    ) -> None:
        super().__init__()
        if alpha < 0 or sketches < 1 or local_steps < 1:
            raise ConfigError(
                f"PowerInitLocalGD: need alpha ≥ 0, sketches ≥ 1, local_steps ≥ 1, got {alpha}/{sketches}/{local_steps}"
            )
        self.alpha, self.sketches, self.local_steps = alpha, sketches, local_steps
        self.nesterov, self.kappa_rank = nesterov, kappa_rank

    @property
    def communications(self) -> int:
        return self.alpha + 1

    def setup(self, global_params: Params, num_clients: int) -> None:
        d, r = global_params["V"].shape
        self.num_clients = num_clients
        self.register_buffer("candidates", torch.zeros(self.sketches, d, r, dtype=global_params["V"].dtype))
        self.register_buffer("kappa", torch.zeros(self.sketches, dtype=torch.float64))

    def init_client_state(self, global_params: Params) -> Params:
        return {"U": torch.zeros_like(global_params["U"]), "Y": torch.zeros_like(global_params["U"])}

    def upload_template(self, global_params: Params) -> Params:
        return {"sketch": self.candidates}

    def download_template(self, global_params: Params) -> Params:
        return {"V": global_params["V"]}

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        v = global_params["V"]
        s, n = ctx.y.to(v.dtype), ctx.num_samples
        if n > state["U"].shape[0]:
            raise ConfigError(f"LowRankFactors.max_rows={state['U'].shape[0]} < client {ctx.client}'s {n} rows")
        if ctx.round == 0:
            phi = torch.randn(self.sketches, n, v.shape[1], generator=ctx.generator, dtype=v.dtype)
            return ClientUpdate({"sketch": s.T @ phi}, dict(state), 1)
        if ctx.round <= self.alpha:
            return ClientUpdate({"sketch": power_products(s, self.candidates)}, dict(state), 1)
        start = (ctx.round - self.alpha - 1) * self.local_steps
        if start == 0:
            u = torch.randn(n, v.shape[1], generator=ctx.generator, dtype=v.dtype) / n**0.5
            y = u
        else:
            u, y = state["U"][:n], state["Y"][:n]
        u, y, losses = local_gd(s, v, u, y, self.local_steps, start, self.nesterov, self.local_steps)
        new_u, new_y = state["U"].clone(), state["Y"].clone()
        new_u[:n], new_y[:n] = u, y
        return ClientUpdate({"sketch": torch.zeros_like(self.candidates)}, {"U": new_u, "Y": new_y}, 1, losses[-1])

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if facts.round > self.alpha:
            return
        self.candidates.copy_(averaged_extra["sketch"] * self.num_clients)  # the sum = N · mean
        if facts.round == self.alpha:
            kappas = torch.tensor([condition_number(c, self.kappa_rank) for c in self.candidates])
            self.kappa.copy_(kappas)
            global_params["V"].copy_(self.candidates[int(kappas.argmin())])
