"""MOON (Li, He & Song, CVPR 2021, §3 and Algorithm 1): model-contrastive federated learning.

A global-model method (FedAvg's server, evaluated with the global model) whose local loss adds a contrastive term
on the representation z = R_w(x) (the ``SplitModel`` body's output, flattened). For each sample, with z_glob from
the global model w^t the client received and z_prev from the client's own local model of its previous round,

    ℓ_con = −log( exp(sim(z, z_glob)/τ) / (exp(sim(z, z_glob)/τ) + exp(sim(z, z_prev)/τ)) )      (eq. 3)

with sim the cosine similarity: the global representation is the positive pair, the previous local one the
negative. A sampled client starts from w^t and runs ``local_epochs`` epochs of local SGD on
ℓ_sup(w; x, y) + μ·ℓ_con(w; w^t, w_i^{prev}; x) (eq. 4), averaged over the minibatch, uploads its model and
keeps it as its next w_i^{prev} (client bank, ``prev.``). The server averages the uploads (FedAvg).

Conventions, from the authors' code (github.com/QinbinLi/MOON, ``main.py``: ``train_net_fedcon`` and its
argument parser): both terms are ``nn.CrossEntropyLoss`` means over the minibatch, ``loss = loss1 + mu * loss2``
with loss2 the cross-entropy of the cosine logits / τ against the positive (index 0); the server averages the
sampled clients' models weighted by their sample counts (``fed_avg_freqs``) and the global model is evaluated.
Defaults: μ = 1 and τ = 0.5, the defaults of that ``main.py`` (``--mu`` 1, ``--temperature`` 0.5). The paper uses
μ = 5 on CIFAR-10 (§4.1, and the README's CIFAR-10 command) and 1 on CIFAR-100; the README asks to tune μ in
{0.001, 0.01, 0.1, 1, 5, 10} on other settings. On the digits split μ = 5 collapses the global model to chance
(docs/pfl_baselines_digits.md).

Choices: the paper's representation is a projection head's output on top of the base encoder; here it is the
body's output (no extra layers, so that MOON runs on every ``SplitModel``); a client that has not yet trained uses
the initial global model as w_i^{prev} (its first round's ℓ_con is the constant log 2, of zero gradient; the
authors' first round has no negative at all, also of zero gradient).

The loss is an ``Objective`` with w^t and w_i^{prev} as its per-client data, so MOON runs on both executors.

Privacy: the upload is trained with the negative pair computed by the client's previous local model, so it
depends on that model (declared); the previous model itself (``prev.``) is never uploaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.representation import body_features, features_and_outputs, require_body
from fl_lightning.client import Client, Objective, Params
from fl_lightning.errors import ConfigError

PREVIOUS = "prev."
GLOBAL = "glob."  #: the global model w^t in the objective's data


def contrastive_loss(z: Tensor, positive: Tensor, negative: Tensor, temperature: float) -> Tensor:
    """Eq. 3 per sample: −log softmax over (sim(z, positive), sim(z, negative)) / τ, taking the positive."""
    logits = torch.stack([F.cosine_similarity(z, positive, dim=1), F.cosine_similarity(z, negative, dim=1)], 1)
    return -torch.log_softmax(logits / temperature, dim=1)[:, 0]


class MOON(Algorithm):
    vectorizable = True  # ctx.sgd with an Objective (the fixed models as its per-client data)
    state_prefixes = (PREVIOUS,)
    reveals = (
        "the local model after SGD with the contrastive term, whose negative pair comes from the client's previous "
        "local model: the update depends on that model (never sent itself)"
    )
    state_dependent_uploads = ("",)

    def __init__(self, mu: float = 1.0, temperature: float = 0.5, local_epochs: int = 1) -> None:
        super().__init__()
        if mu < 0 or temperature <= 0:
            raise ConfigError(f"MOON needs mu ≥ 0 and temperature > 0, got {mu} and {temperature}")
        self.mu, self.temperature, self.local_epochs = mu, temperature, local_epochs

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        require_body("MOON", net, "its contrastive loss compares the body's representations")

    def init_client_state(self, global_params: Params) -> Params:
        return {PREVIOUS + n: global_params[n] for n in self.trained_names(global_params)}

    def previous_model(self, global_params: Params, state: Params) -> Params:
        return {n: state.get(PREVIOUS + n, t) for n, t in global_params.items()}

    def objective(self, ctx: Client, global_params: Params, previous: Params) -> Objective:
        """ℓ_sup + μ·ℓ_con per sample, the positive and negative representations from fixed models carried as the
        objective's per-client data (copies: a BatchNorm layer in train mode updates its running statistics in
        place on the sequential path)."""
        data = {GLOBAL + n: t.detach().clone() for n, t in global_params.items()}
        data.update({PREVIOUS + n: t.detach().clone() for n, t in previous.items()})

        def loss(params: Params, x: Tensor, y: Tensor, fixed: Params) -> Tensor:
            z, out = features_and_outputs(ctx.net, params, x, ctx.side_for(x.shape[0]))
            with torch.no_grad():
                positive = body_features(ctx.net, _under(fixed, GLOBAL), x)
                negative = body_features(ctx.net, _under(fixed, PREVIOUS), x)
            return ctx.per_sample_loss(out, y) + self.mu * contrastive_loss(z, positive, negative, self.temperature)

        return Objective(loss, data)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        previous = self.previous_model(global_params, state)
        objective = self.objective(ctx, global_params, previous)
        params = ctx.sgd(dict(global_params), ctx.param_names, self.local_epochs, objective=objective)
        trained = self.trained_names(params)
        return ClientUpdate(
            upload={n: params[n] for n in trained},
            state={PREVIOUS + n: params[n] for n in trained},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )


def _under(params: Params, prefix: str) -> Params:
    return {n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}
