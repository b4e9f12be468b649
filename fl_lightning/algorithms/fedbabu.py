"""FedBABU (J. Oh, S. Kim, S.-Y. Yun, ICLR 2022, Algorithm 1): federated body training with a frozen random head.

During federated training the head (classifier) keeps its random initialisation: every sampled client trains only
the body for ``local_epochs`` epochs of local SGD through that fixed head, and the server averages the bodies
(FedAvg on the body). The head is never updated and never uploaded; it is the same on every client (it comes with
the initial model, so it is not counted in the per-round download either).

Personalisation happens at evaluation: each client fine-tunes the head of the global model on its own training data
and is evaluated once with the result ("the head is fine-tuned for personalization during the evaluation process",
the paper's abstract). That is the engine's ``model.finetune`` option ("+FT"), which the FedBABU configs set to
τ_f = 5 head epochs (the paper's fine-tuning epochs, as we read its experiments; ``prefixes: [""]`` fine-tunes
the whole network instead). The configs do the same for held-out new clients (``model.new_client_finetune``).

FedBABU keeps no client state; the body's upload depends only on the global model and the client's data.
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import ClientContext, Params
from fl_lightning.errors import ConfigError

HEAD = "head."


class FedBABU(Algorithm):
    vectorizable = True  # written only with ctx.sgd and dict operations
    reveals = "the body after local SGD through the shared, fixed random head; no client state exists"

    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__()
        self.local_epochs = local_epochs

    def setup(self, global_params: Params, num_clients: int) -> None:
        if not any(n.startswith(HEAD) for n in global_params):
            raise ConfigError(
                "FedBABU needs a network with a `head` (the classifier it keeps fixed at its random initialisation "
                "while the body is trained): use a SplitModel"
            )

    def body_names(self, params: Params) -> list[str]:
        """What is trained and averaged: every non-frozen name outside the head (body parameters and buffers)."""
        return [n for n in self.shared_names(params) if not n.startswith(HEAD)]

    def upload_template(self, global_params: Params) -> Params:
        return {n: global_params[n] for n in self.body_names(global_params)}

    def download_template(self, global_params: Params) -> Params:
        return self.upload_template(global_params)

    def client_update(self, ctx: ClientContext, global_params: Params, state: Params) -> ClientUpdate:
        params = ctx.sgd(dict(global_params), ctx.params_without((HEAD,)), self.local_epochs)
        upload = {n: params[n] for n in self.body_names(params)}
        return ClientUpdate(upload, {}, ctx.num_samples, loss=ctx.train_loss)
