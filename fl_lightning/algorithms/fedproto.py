"""FedProto (Tan et al., AAAI 2022, Algorithm 1): clients exchange class prototypes, never model parameters.

Every client's whole model is personal (``body.`` and ``head.`` stay in the client bank). The prototype of class j
on client i is the mean body representation of its training samples of that class (§"Problem Setting"):
C_i^(j) = (1/|D_ij|) Σ_{(x,y) ∈ D_ij} φ_i(x). A sampled client

1. trains its model for ``local_epochs`` epochs of local SGD on CE(F_i(x), y) + λ·MSE(φ_i(x), C̄^(y)) (the local
   loss, §"Local Model Update"), where C̄^(y) is the global prototype of the sample's class and MSE is the
   authors' ``nn.MSELoss()``: the mean over the batch AND the d features (``lib/update.py``,
   ``LocalUpdate.update_weights_het`` of github.com/yuetan031/FedProto, ``loss = loss1 + loss2 * args.ld``).
   A sample of a class without a global prototype contributes a zero distance but still counts in the mean (the
   authors copy its own feature into the target);
2. computes its prototypes from the body representations of its last local epoch's training batches (Algorithm 1
   computes them inside the training loop; the authors' ``update_weights_het`` collects every batch's features of
   the last epoch, before that batch's step: no second pass over the data) and uploads them with the per-class
   counts of those samples (|D_ij| when the epoch covers all of them).

The server averages per class, weighted by the counts: C̄^(j) = Σ_i |D_ij| C_i^(j) / Σ_i |D_ij| (§"Global
Prototype Aggregation"; Appendix B writes it as Σ_i q_i C_i with Σ_i q_i = 1, which we follow: the main text's
formula carries an extra 1/|N_j|). The global prototypes are server state, sent to the sampled clients.
A client predicts the class of the nearest global prototype, ŷ = argmin_j ‖φ_i(x) − C̄^(j)‖₂ (§"Prototype-based
model inference"; ``inference: head`` uses the client's own head instead). "+FT" and held-out new clients
fine-tune on the same local loss (the paper's §"Model Inference" for clients that join later).

How it crosses the boundary: a client uploads ``class_feature_sums`` = |D_ij|·C_i^(j) and ``class_counts`` = |D_ij|
(the prototype is their ratio), so that the engine's plain mean of the uploads over the cohort gives the
count-weighted mean exactly; hence ``model.aggregation: uniform`` is required (checked). Classes that no client
of a round holds keep their previous global prototype (the paper samples every client each round).

Choices: λ = 1 (``--ld`` default of the authors' ``lib/options.py``; the paper's MNIST/FEMNIST value, Appendix A;
0.1 on CIFAR-10), in the authors' unit: the squared distance is averaged over features and batch, so our λ = 1 is
their λ = 1 (before issue 31 the distance was summed over features, i.e. d× theirs). The representation is the
``SplitModel`` body's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.algorithms.representation import body_features, features_and_outputs, require_body
from fl_lightning.client import Client, Objective, Params
from fl_lightning.errors import ConfigError

SUMS = "class_feature_sums"
COUNTS = "class_counts"


class FedProto(Algorithm):
    vectorizable = True  # ctx.sgd with an Objective, ctx.class_sums and ctx.label_counts
    personal = ("body.", "head.")
    reveals = (
        "per-class prototypes of the client's body features (uploaded as per-class feature sums) and its per-class "
        "sample counts (its label histogram); no model parameters"
    )
    state_dependent_uploads = (SUMS,)
    needs_uniform_aggregation = True

    def __init__(
        self, lam: float = 1.0, local_epochs: int = 1, inference: Literal["prototype", "head"] = "prototype"
    ) -> None:
        super().__init__()
        if lam < 0:
            raise ConfigError(f"FedProto lam must be ≥ 0, got {lam}")
        if inference not in ("prototype", "head"):
            raise ConfigError(f"FedProto inference must be 'prototype' or 'head', got {inference!r}")
        self.lam, self.local_epochs, self.inference = lam, local_epochs, inference
        self.register_buffer("global_prototypes", torch.zeros(0, 0))  # C̄ [classes, features], sized by the network
        self.register_buffer("prototype_counts", torch.zeros(0))  # Σ_i |D_ij| of the latest round that had class j

    # -- what it needs, and the server state --------------------------------------------------------------
    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        if num_classes is None:
            raise ConfigError("FedProto needs a classification task (one prototype per class); this run is regression")
        require_body("FedProto", net, "its prototypes are the body's features")
        if getattr(net, "side", None) is not None:
            raise ConfigError("FedProto needs a network without a side-information branch (its prototypes are φ(x))")
        first = next((m for m in net.head.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise ConfigError("FedProto needs a head starting with a linear layer (its input is the prototype space)")
        self.size_prototypes(num_classes, first.in_features)

    def size_prototypes(self, num_classes: int, features: int) -> None:
        """Zero prototypes ``[num_classes, features]`` (kept when already of that size, e.g. restored)."""
        if tuple(self.global_prototypes.shape) != (num_classes, features):
            self.global_prototypes = torch.zeros(num_classes, features, device=self.global_prototypes.device)
            self.prototype_counts = torch.zeros(num_classes, device=self.prototype_counts.device)

    @property
    def known(self) -> Tensor:
        """Which classes have a global prototype."""
        return self.prototype_counts > 0

    def upload_template(self, global_params: Params) -> Params:
        return {SUMS: self.global_prototypes, COUNTS: self.prototype_counts}

    def download_template(self, global_params: Params) -> Params:
        return {"global_prototypes": self.global_prototypes}

    # -- client --------------------------------------------------------------------------------------------
    def objective(self, ctx: Client, collect: bool = False) -> Objective:
        """CE(F(x), y) + λ·mean_k (φ(x)_k − C̄^(y)_k)² per sample, so that the minibatch mean is the authors'
        CE + λ·``nn.MSELoss`` (mean over batch and features); the distance is zero for samples whose class has no
        global prototype (they still count in the mean). The prototypes are the same for every client: no
        per-client data. With ``collect`` the phase also sums φ(x) of its last epoch's batches per class
        (``ctx.class_sums_seen``: the local prototypes)."""
        prototypes, known = self.global_prototypes.detach(), self.known

        def loss(params: Params, x: Tensor, y: Tensor, data: Params) -> tuple[Tensor, None, Tensor]:
            features, out = features_and_outputs(ctx.net, params, x, ctx.side_for(x.shape[0]))
            distance = ((features - prototypes[y]) ** 2).mean(1) * known[y]
            return ctx.per_sample_loss(out, y) + self.lam * distance, None, features

        return Objective(loss, collect=tuple(self.global_prototypes.shape) if collect else None)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        """Local training, whose last epoch's features give the prototypes (Algorithm 1 computes them inside the
        training loop; the authors' ``update_weights_het`` collects ``protos`` of every batch of the last epoch)."""
        params = self.client_model(global_params, state)
        params = ctx.sgd(params, ctx.param_names, self.local_epochs, objective=self.objective(ctx, collect=True))
        sums, counts = ctx.class_sums_seen
        return ClientUpdate(
            upload={SUMS: sums, COUNTS: counts},
            state={n: params[n] for n in state},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )

    def finetune(self, ctx: Client, params: Params, epochs: int, prefixes: Sequence[str]) -> Params:
        return ctx.sgd(params, ctx.params_with(prefixes), epochs, objective=self.objective(ctx))

    def predict(self, net: nn.Module, params: Params, x: Tensor, side: Tensor | None) -> Tensor:
        """Logits −‖φ(x) − C̄^(j)‖²₂ (argmax = nearest global prototype). A class without a global prototype is
        never predicted: its logit is one below the farthest known prototype's. Before any prototype exists (or
        with ``inference: head``) the client's own head."""
        known = self.known
        if self.inference == "head" or not bool(known.any()):
            return functional_call(net, params, (x,), {"side": side}, strict=False)
        logits = -torch.cdist(body_features(net, params, x), self.global_prototypes).pow(2)
        floor = logits[:, known].min(dim=1, keepdim=True).values - 1
        return torch.where(known, logits, floor)

    # -- server --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        """C̄^(j) = mean_i(|D_ij| C_i^(j)) / mean_i |D_ij| over the round's uploads, for the classes they hold."""
        if SUMS not in averaged_extra:
            return
        sums, counts = averaged_extra[SUMS], averaged_extra[COUNTS]
        held = counts > 0
        self.global_prototypes[held] = (sums[held] / counts[held, None]).to(self.global_prototypes.dtype)
        self.prototype_counts[held] = (counts[held] * facts.num_aggregated).to(self.prototype_counts.dtype)
