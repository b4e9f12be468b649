"""FedBABU (J. Oh, S. Kim, S.-Y. Yun, ICLR 2022, Algorithm 1): federated body training with a frozen random head.

During federated training the head (classifier) keeps its random initialisation: every sampled client trains only
the body for ``local_epochs`` epochs of local SGD through that fixed head, and the server averages the bodies
(FedAvg on the body). The head is never updated and never uploaded; it is the same on every client (it comes with
the initial model, so it is not counted in the per-round download either).

Personalisation happens at evaluation: each client fine-tunes the global model on its own training data and is
evaluated once with the result. That is the engine's ``model.finetune`` option ("+FT"), whose default is the
WHOLE model (``prefixes: [""]``); the FedBABU configs state it and the authors' τ_f = 5 epochs, at the run's learning
rate and momentum. The authors' fine-tuning is in ``analysis.ipynb`` of github.com/jhoon-oh/FedBABU
(``personalization_epoch = 5``, and ``utils/options.py``'s ``--ft_ep`` defaults to 5; one SGD optimizer over
``body_params`` and ``head_params``, both at ``args.lr``; the batch size ``local_bs``; PFLlib's ``clientBABU`` also
tunes body and head, for its own default of 10 epochs), with lr 1e-3 and momentum 0.9, which is the last learning
rate of their training schedule
(``scripts/run_fedbabu.sh``: lr 0.1, decayed ×0.1 at 1/2 and 3/4 of the rounds in ``main_fed.py``); our runs
have no schedule, so "the last learning rate" is the run's ``model.lr``. The paper's abstract says "the head is
fine-tuned"; its experiments fine-tune the whole network (as the notebook does). The head-only variant stays
available as ``--model.finetune.prefixes '[head.]'`` (and the same for ``model.new_client_finetune``).
The configs fine-tune held-out new clients the same way (``model.new_client_finetune``).

Conventions (``models/Update.py`` ``LocalUpdate.train``, ``main_fed.py``): the local objective is the batch mean
``nn.CrossEntropyLoss``, the head's lr is 0 during training (``--local_upt_part body``), and the server averages
the bodies with equal weights (``w_glob[k] / m``; ``--aggr_part body``); our weights are ``model.aggregation``.

FedBABU keeps no client state; the body's upload depends only on the global model and the client's data.
"""

from __future__ import annotations

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params
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

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        params = ctx.sgd(dict(global_params), ctx.params_without((HEAD,)), self.local_epochs)
        upload = {n: params[n] for n in self.body_names(params)}
        return ClientUpdate(upload, {}, ctx.num_samples, loss=ctx.train_loss)
