"""FedAvg (McMahan et al., 2017; spec 000 §2.4): E epochs of local SGD on the whole model, then averaging.

Evaluated with the global model. "+FT" (head-only fine-tuning after training) is the engine's
``finetune`` option, usable with any algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params


class FedAvg(Algorithm):
    """Joint local SGD on every parameter; parameters under ``personal`` prefixes stay on the client."""

    vectorizable = True  # written only with ctx.sgd and dict operations

    def __init__(self, local_epochs: int = 1, personal: Sequence[str] | None = None) -> None:
        super().__init__(personal)
        self.local_epochs = local_epochs

    @property
    def reveals(self) -> str:  # type: ignore[override]
        if not self.personal:
            return "the local SGD update of the model on the client's data; no client state exists"
        return (
            "the shared layers after joint SGD with the client's personal layers "
            f"({', '.join(self.personal)}): their update depends on those layers, which are never sent"
        )

    @property
    def state_dependent_uploads(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("",) if self.personal else ()

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        params = ctx.sgd(self.client_model(global_params, state), ctx.param_names, self.local_epochs)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)
