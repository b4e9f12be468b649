"""Fed-MTL (Smith et al., 2017) in the form of the LG-FedAvg code base that FedRep cites (spec 000 §2.4, §8.2).

Every client learns its own full model w_i (client bank). The models are tied by the MOCHA-style
task-relationship regulariser R(W) = s·(‖W‖² + tr(W Ω Wᵀ)), W = [w_1 … w_m] (one column per client),
Ω = (I − 11ᵀ/m)², with scale s = 10^−f, f = (number of digits of dim W) + 1, as in that code.

Since Ω is the (idempotent) centering matrix, tr(WΩWᵀ) = Σ_j ‖w_j − w̄‖², and with the other columns fixed
∂R/∂w_j = s·(2w_j + 2(w_j − w̄)). A client therefore needs only w̄: its local objective is
f_j(w) + s·(‖w‖² + ‖w − w̄‖²) (same gradient, w̄ held fixed), trained for ``local_epochs`` epochs.

Formulation within the engine hooks: the LG-FedAvg code takes the columns of W (and m) from the clients
sampled this round, at the round's start, which a client cannot see before the round. Here W holds all
N clients (Ω over the population, whose mean the cohort mean estimates); the server keeps
w̄ = mean_i w_i exactly as the global model, from uploaded deltas: w̄ ← w̄ + (|S|/N)·mean Δw_i.
The only upload is Δw_i (what MOCHA also communicates); clients are evaluated with w_i.

Aggregation must be uniform (``model.aggregation: uniform``, checked): w̄ stays the plain mean of the w_i only if
every Δw_i counts once. |S| is the number of uploads the engine aggregated.

Privacy: Δw_i is the change of the client's personal model w_i, so it depends on w_i; w_i itself is declared
state (``w.``). Frozen parameters are neither uploaded nor kept in w_i.
"""

from __future__ import annotations

import math

from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate, PersonalModels
from fl_lightning.client import Client, Params, Penalty

LOCAL = "w."
DELTA = "delta_w."


def code_scale(dim: int) -> float:
    """10^−f with f = (digits of ``dim``) + 1: the LG-FedAvg code's scale of the regulariser."""
    return 10.0 ** -(int(math.log10(dim) + 1) + 1)


class FedMTL(PersonalModels):
    local_prefix, delta_prefix = LOCAL, DELTA
    vectorizable = True  # ctx.sgd with a Penalty and dict operations
    state_prefixes = (LOCAL,)
    reveals = "Δw_i, the change of the client's personal model w_i over its local epochs (a function of w_i)"
    state_dependent_uploads = (DELTA,)
    needs_uniform_aggregation = True

    def __init__(self, local_epochs: int = 1, reg_scale: float | None = None) -> None:
        super().__init__()
        self.local_epochs, self.reg_scale = local_epochs, reg_scale
        self.num_clients, self.scale = 0, 0.0

    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        dim = sum(t.numel() for t in global_params.values() if t.is_floating_point())
        self.scale = code_scale(dim) if self.reg_scale is None else self.reg_scale

    def penalty(self, params: Params, mean: Params) -> Tensor:
        """s·(‖w‖² + ‖w − w̄‖²): the regulariser's terms in the client's column (same gradient, w̄ fixed)."""
        return self.scale * sum((params[n] ** 2).sum() + ((params[n] - mean[n]) ** 2).sum() for n in mean)

    def regulariser_gradient(self, params: Params, mean: Params) -> Params:
        """Its gradient s·(2w + 2(w − w̄)), added to the minibatch gradient without an autograd pass."""
        return {n: self.scale * (2 * params[n] + 2 * (params[n] - mean[n])) for n in mean}

    def regulariser(self, mean: Params, names: list[str]) -> Penalty:
        return Penalty(self.penalty, {n: mean[n] for n in names}, self.regulariser_gradient)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        w = self.client_model(global_params, state)
        mean = {n: global_params[n].detach() for n in ctx.param_names}
        new = ctx.sgd(w, ctx.param_names, self.local_epochs, penalty=self.regulariser(mean, ctx.param_names))
        return self.personal_update(ctx, w, new, ctx.train_loss)
