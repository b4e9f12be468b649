"""FedRep (Collins et al., 2021; spec 000 Algorithm 1): alternating head and body updates.

Each sampled client first trains its personal head for ``head_epochs`` epochs with the body frozen, then
the body for ``body_epochs`` epochs with the new head frozen. Only the body is uploaded; heads never
leave the clients, but the body's gradients are computed through the client's head, so the uploaded body
depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params


class FedRep(Algorithm):
    vectorizable = True  # written only with ctx.sgd and dict operations
    reveals = "the body after its epochs with the client's personal head frozen: the body update depends on that head"
    state_dependent_uploads = ("",)

    def __init__(self, head_epochs: int = 10, body_epochs: int = 1, personal: Sequence[str] = ("head.",)) -> None:
        super().__init__(personal)
        self.head_epochs, self.body_epochs = head_epochs, body_epochs
        # its head epochs train the personal parameters alone: a head-only phase where those are the head's
        self.head_only_phase = head_epochs > 0 and all(p.startswith("head.") for p in self.personal)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        params = self.client_model(global_params, state)
        params = ctx.sgd(params, ctx.params_with(self.personal), self.head_epochs)
        params = ctx.sgd(params, ctx.params_without(self.personal), self.body_epochs)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)
