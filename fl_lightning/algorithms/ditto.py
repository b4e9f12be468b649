"""Ditto (Li et al., 2021, Algorithm 1; spec 000 §2.4): a FedAvg global model plus personal models.

Each sampled client (i) trains the global model w for ``local_epochs`` epochs of SGD on f_i and uploads
it (FedAvg), and (ii) trains its personal model v_i, kept in the client bank, for ``personal_epochs``
epochs on f_i(v) + λ/2‖v − w^t‖², where w^t is the global model it received. Clients are evaluated
with v_i. λ = 0.75, or 1 on CIFAR-100 (spec 000 §2.4).

Privacy: the upload w is trained from the received global model only, so it does not depend on v_i (bit for bit);
v_i lives in the client bank under ``v.`` (declared, so the ledger refuses it). Frozen parameters are neither
uploaded nor copied into v_i.
"""

from __future__ import annotations

from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params, Penalty
from fl_lightning.errors import ConfigError

PERSONAL = "v."


class Ditto(Algorithm):
    vectorizable = True  # ctx.sgd with a Penalty and dict operations
    state_prefixes = (PERSONAL,)
    reveals = "the FedAvg update of the global model on the client's data; nothing of its personal model v_i"

    def __init__(self, lam: float = 0.75, local_epochs: int = 1, personal_epochs: int | None = None) -> None:
        super().__init__()
        if lam < 0:
            raise ConfigError(f"Ditto lam must be ≥ 0, got {lam}")
        self.lam, self.local_epochs = lam, local_epochs
        self.personal_epochs = local_epochs if personal_epochs is None else personal_epochs

    def init_client_state(self, global_params: Params) -> Params:
        return {PERSONAL + n: global_params[n] for n in self.trained_names(global_params)}

    def client_model(self, global_params: Params, state: Params) -> Params:
        return {n: state.get(PERSONAL + n, t) for n, t in global_params.items()}

    def proximal(self, params: Params, anchor: Params) -> Tensor:
        """λ/2‖v − w^t‖² over the trained parameters."""
        return 0.5 * self.lam * sum(((params[n] - anchor[n]) ** 2).sum() for n in anchor)

    def proximal_gradient(self, params: Params, anchor: Params) -> Params:
        """Its gradient λ(v − w^t), added to the minibatch gradient without an autograd pass through the term."""
        return {n: self.lam * (params[n] - anchor[n]) for n in anchor}

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        w = ctx.sgd(dict(global_params), ctx.param_names, self.local_epochs)
        w = {n: w[n] for n in self.trained_names(w)}
        global_loss = ctx.train_loss
        anchor = {n: global_params[n].detach() for n in ctx.param_names}
        v = ctx.sgd(
            self.client_model(global_params, state),
            ctx.param_names,
            self.personal_epochs,
            penalty=Penalty(self.proximal, anchor, self.proximal_gradient),
        )
        return ClientUpdate(
            upload=w,
            state={PERSONAL + n: v[n] for n in self.trained_names(v)},
            num_samples=ctx.num_samples,
            loss=global_loss,
        )
