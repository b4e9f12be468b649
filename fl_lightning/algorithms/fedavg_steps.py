"""FedAvg counted in local SGD steps τ (spec 004 §2.4): τ = 50 at batch 10 on 500 samples is one local epoch, and
τ = 1 is D-SGD (one minibatch gradient per client per round, then averaging; spec 004 §2.2).

Comparisons at equal total local work fix T·τ (spec 004: T = 2,500 with τ = 50 against T = 125,000 with τ = 1).
A fresh local optimiser per round (``ctx.sgd``), so momentum does not persist across rounds.
"""

from __future__ import annotations

import math

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params
from fl_lightning.errors import ConfigError


class FedAvgSteps(Algorithm):
    """Joint local SGD on every parameter for exactly ``local_steps`` minibatch steps, then averaging."""

    reveals = "the model after local_steps SGD steps on the client's data; no client state exists"

    def __init__(self, local_steps: int = 50) -> None:
        super().__init__()
        if local_steps < 1:
            raise ConfigError(f"FedAvgSteps.local_steps must be ≥ 1, got {local_steps}")
        self.local_steps = local_steps

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        per_epoch = max(1, math.ceil(ctx.num_samples / ctx.optimizer.batch_size))
        epochs = math.ceil(self.local_steps / per_epoch)
        params = ctx.sgd(dict(global_params), ctx.param_names, epochs, max_steps=self.local_steps)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)
