"""FedProx (Li et al., 2018; spec 000 §2.4): FedAvg whose local objective adds μ/2‖w − w_global‖².

Each sampled client runs ``local_epochs`` epochs of SGD on f_i(w) + μ/2‖w − w^t‖², where w^t is the
global model it received (Li et al. eq. 2), and uploads w. Evaluated with the global model; "+FT" is the
engine's ``finetune`` option. μ = 0.1 on CIFAR, 0.25 on FEMNIST and Sent140 (spec 000 §2.4).

The anchor w^t travels as the proximal ``Penalty``'s data, so the vectorized executor gives every client its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.client import Client, Params, Penalty
from fl_lightning.errors import ConfigError


class FedProx(Algorithm):
    vectorizable = True  # ctx.sgd with a Penalty and dict operations
    reveals = FedAvg.reveals  # the same declaration as FedAvg (personal prefixes optional)
    state_dependent_uploads = FedAvg.state_dependent_uploads

    def __init__(self, mu: float = 0.1, local_epochs: int = 1, personal: Sequence[str] | None = None) -> None:
        super().__init__(personal)
        if mu < 0:
            raise ConfigError(f"FedProx mu must be ≥ 0, got {mu}")
        self.mu, self.local_epochs = mu, local_epochs

    def proximal(self, params: Params, anchor: Params) -> Tensor:
        """μ/2‖w − w^t‖² over the trained parameters."""
        return 0.5 * self.mu * sum(((params[n] - anchor[n]) ** 2).sum() for n in anchor)

    def proximal_gradient(self, params: Params, anchor: Params) -> Params:
        """Its gradient μ(w − w^t), added to the minibatch gradient without an autograd pass through the term."""
        return {n: self.mu * (params[n] - anchor[n]) for n in anchor}

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        start = self.client_model(global_params, state)
        anchor = {n: start[n].detach() for n in ctx.param_names}
        penalty = Penalty(self.proximal, anchor, self.proximal_gradient)
        params = ctx.sgd(start, ctx.param_names, self.local_epochs, penalty=penalty)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)
