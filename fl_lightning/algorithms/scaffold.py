"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1 with option II; spec 000 §2.4).

Client i (control variate c_i in the client bank, server variate c downloaded with the model) runs K local
SGD steps on the drift-corrected gradient g_i(y) − c_i + c, starting from y = x, then sets
c_i⁺ = c_i − c + (x − y)/(K·η) (option II) and uploads (Δy, Δc_i) = (y − x, c_i⁺ − c_i).
The server applies x ← x + η_g·mean Δy through the engine's server optimiser (``server_lr`` = η_g:
1, or 0.5 on FEMNIST) and c ← c + (|S|/N)·mean Δc_i in ``server_update``.

Notes: the correction enters as the linear penalty ⟨y, c − c_i⟩, whose gradient is c − c_i; local SGD
uses the run's momentum and weight decay as every other method does (spec 000 §3.2), so (x − y)/(Kη)
is the mean *applied* step direction. The means are the engine's aggregation weights (the plain mean
with ``aggregation: uniform`` or equal client sizes). The authors' gradient clipping at 10 (spec §8.2)
is not applied.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.local import ClientContext, Params

DELTA = "delta_c."
STATE = "c_i."


def _key(name: str) -> str:
    return "c__" + name.replace(".", "__")


class CohortCounter:
    """Counts this round's client updates, so a server step can scale a mean by |S|/N (SCAFFOLD's c,
    population means). Summed over ranks when the engine runs clients on several processes."""

    _count: int = 0

    def count_client(self) -> None:
        self._count += 1

    def take_cohort_size(self, like: Tensor) -> int:
        count = torch.tensor(float(self._count), device=like.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(count)
        self._count = 0
        return int(count.item())


def local_steps(ctx: ClientContext, epochs: int) -> int:
    """K: the number of minibatch steps ``ctx.sgd`` takes in ``epochs`` epochs."""
    return epochs * math.ceil(ctx.num_samples / ctx.optimizer.batch_size)


class SCAFFOLD(CohortCounter, Algorithm):
    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__()
        self.local_epochs = local_epochs
        self.names: list[str] = []
        self.num_clients = 0

    # server state -------------------------------------------------------------------------------------
    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        self.names = [n for n in global_params if global_params[n].is_floating_point()]
        for n in self.names:
            if not hasattr(self, _key(n)):
                self.register_buffer(_key(n), torch.zeros_like(global_params[n]))

    def server_variate(self) -> Params:
        return {n: getattr(self, _key(n)) for n in self.names}

    def init_client_state(self, global_params: Params) -> Params:
        return {STATE + n: torch.zeros_like(global_params[n]) for n in self.names}

    def upload_template(self, global_params: Params) -> Params:
        return {**{n: global_params[n] for n in global_params}, **{DELTA + n: global_params[n] for n in self.names}}

    def download_template(self, global_params: Params) -> Params:
        return {**global_params, **self.server_variate()}

    def client_model(self, global_params: Params, state: Params) -> Params:
        return dict(global_params)

    # client and server math -----------------------------------------------------------------------------
    def client_update(self, ctx: ClientContext, global_params: Params, state: Params) -> ClientUpdate:
        self.count_client()
        c = self.server_variate()
        trained = [n for n in ctx.param_names if n in c]  # buffers keep c_i = c = 0
        correction = {n: (c[n] - state[STATE + n]).detach() for n in trained}

        def drift(params: Params) -> Tensor:
            return sum((params[n] * correction[n]).sum() for n in trained)

        params = ctx.sgd(dict(global_params), ctx.param_names, self.local_epochs, penalty=drift)
        steps = local_steps(ctx, self.local_epochs)
        new_state, upload = {}, dict(params)
        for n in self.names:
            c_i = state[STATE + n]
            c_new = c_i
            if steps and n in correction:
                c_new = c_i - c[n] + (global_params[n] - params[n]) / (steps * ctx.optimizer.lr)
            new_state[STATE + n] = c_new
            upload[DELTA + n] = c_new - c_i
        return ClientUpdate(upload, new_state, ctx.num_samples, loss=ctx.train_loss)

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, round_idx: int) -> None:
        cohort = self.take_cohort_size(next(iter(global_params.values())))
        if not averaged_extra:
            return
        for n in self.names:
            getattr(self, _key(n)).add_(averaged_extra[DELTA + n], alpha=cohort / self.num_clients)
