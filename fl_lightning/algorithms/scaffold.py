"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1 with option II; spec 000 §2.4).

Client i (control variate c_i in the client bank, server variate c downloaded with the model) runs K local
SGD steps on the drift-corrected gradient g_i(y) − c_i + c, starting from y = x, then sets
c_i⁺ = c_i − c + (x − y)/(K·η) (option II) and uploads (Δy, Δc_i) = (y − x, c_i⁺ − c_i).
The server applies x ← x + η_g·mean Δy through the engine's server optimiser (``server_lr`` = η_g:
1, or 0.5 on FEMNIST) and c ← c + (|S|/N)·mean Δc_i in ``server_update``.

Notes: the correction enters as the linear penalty ⟨y, c − c_i⟩, whose gradient is c − c_i; local SGD
uses the run's momentum and weight decay as every other method does (spec 000 §3.2), so (x − y)/(Kη)
is the mean *applied* step direction. K is the number of steps the client actually took (a straggler's
step cap included) and |S| the number of uploads the engine aggregated (clients dropped for non-finite
values excluded). The means are the engine's aggregation weights (the plain mean with ``aggregation:
uniform`` or equal client sizes). The authors' gradient clipping at 10 (spec §8.2) is not applied.
Frozen parameters have no control variates and are not uploaded.

Privacy: both uploads are computed with the client's c_i (y is trained on g − c_i + c, and Δc_i = −c +
(x − y)/(Kη)), so they depend on it; c_i itself is declared state (``c_i.``) and never uploaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import Client, Params, Penalty, per_client

DELTA = "delta_c."
STATE = "c_i."


def _key(name: str) -> str:
    return "c__" + name.replace(".", "__")


class SCAFFOLD(Algorithm):
    vectorizable = True  # ctx.sgd with a Penalty, per-client step counts and dict operations
    server_state_broadcasts = True  # c enters only c − c_i and mean_step − c
    state_prefixes = (STATE,)
    reveals = "the model delta and Δc_i, both computed with the client's control variate c_i (not c_i itself)"
    state_dependent_uploads = ("",)

    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__()
        self.local_epochs = local_epochs
        self.names: list[str] = []
        self.num_clients = 0

    # server state -------------------------------------------------------------------------------------
    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        self.names = [n for n in self.trained_names(global_params) if global_params[n].is_floating_point()]
        for n in self.names:
            if not hasattr(self, _key(n)):
                self.register_buffer(_key(n), torch.zeros_like(global_params[n]))

    def server_variate(self) -> Params:
        return {n: getattr(self, _key(n)) for n in self.names}

    def init_client_state(self, global_params: Params) -> Params:
        return {STATE + n: torch.zeros_like(global_params[n]) for n in self.names}

    def upload_template(self, global_params: Params) -> Params:
        return {
            **{n: global_params[n] for n in self.trained_names(global_params)},
            **{DELTA + n: global_params[n] for n in self.names},
        }

    def download_template(self, global_params: Params) -> Params:
        return {**{n: global_params[n] for n in self.trained_names(global_params)}, **self.server_variate()}

    # client and server math -----------------------------------------------------------------------------
    @staticmethod
    def drift(params: Params, correction: Params) -> Tensor:
        """⟨y, c − c_i⟩: its gradient c − c_i turns g_i(y) into the corrected g_i(y) − c_i + c."""
        return sum((params[n] * correction[n]).sum() for n in correction)

    @staticmethod
    def drift_gradient(params: Params, correction: Params) -> Params:
        """Its gradient c − c_i, added to the minibatch gradient without an autograd pass through the term."""
        return dict(correction)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        c = self.server_variate()
        trained = [n for n in ctx.param_names if n in c]  # buffers keep c_i = c = 0
        correction = {n: (c[n] - state[STATE + n]).detach() for n in trained}
        drift = Penalty(self.drift, correction, self.drift_gradient)
        params = ctx.sgd(dict(global_params), ctx.param_names, self.local_epochs, penalty=drift)
        steps = ctx.steps_taken  # K: the steps this client took (a straggler's capped count; one per client)
        new_state, upload = {}, {n: params[n] for n in self.trained_names(params)}
        for n in self.names:
            c_i = state[STATE + n]
            c_new = c_i
            if n in correction:  # c_i⁺ = c_i − c + (x − y)/(K·η); a client that took no step keeps c_i
                mean_step = (global_params[n] - params[n]) / (per_client(steps.clamp(min=1), c_i) * ctx.optimizer.lr)
                c_new = c_i + per_client(steps > 0, c_i) * (mean_step - c[n])
            new_state[STATE + n] = c_new
            upload[DELTA + n] = c_new - c_i
        return ClientUpdate(upload, new_state, ctx.num_samples, loss=ctx.train_loss)

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        if not averaged_extra:
            return
        for n in self.names:
            getattr(self, _key(n)).add_(averaged_extra[DELTA + n], alpha=facts.num_aggregated / self.num_clients)
