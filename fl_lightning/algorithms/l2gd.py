"""L2GD (Hanzely & Richtárik, 2020) as run in FedRep's Table 1 (spec 000 §2.4).

Every client keeps a local model x_i (client bank); the server keeps the population mean x̄ = mean_i x_i
as the global model. Each round flips one coin ξ ~ Bernoulli(p) (p = 0.9), drawn from
``make_generator(seed, "l2gd", round)`` so every client and every rank sees the same coin:

* ξ = 0 (a *local* round, probability 1−p): each sampled client runs ``local_epochs`` epochs of SGD on f_i
  from x_i (FedRep's version replaces the single gradient step by local epochs; spec §2.4);
* ξ = 1 (an *aggregation* round): each sampled client moves x_i ← (1 − ηλ)x_i + ηλ·x̄.

Clients upload Δx_i (a non-parameter key), and the server keeps x̄ exact: x̄ ← x̄ + (|S|/N)·mean Δx_i.
Clients are evaluated with x_i.

Choices, following the authors' code where the paper is silent (spec §8.2 [CODE]):
η = α / (N(1−p)) in the aggregation step (α = 0.25, λ = 1; α = 0.1 on CIFAR-100 (100,5)); the local SGD
uses the run's lr (0.01; 0.001 on FEMNIST, spec §3.2). The code samples every client in L2GD, the
paper says r = 0.1 for all methods: the algorithm works with any participation (a round's step reaches
only the sampled clients); the method configs set ``data.participation: 1`` as the code does.

Aggregation must be uniform (``model.aggregation: uniform``, checked): x̄ stays the plain mean of the x_i only if
every Δx_i counts once. |S| is the number of uploads the engine aggregated.

Privacy: Δx_i is the change of the client's personal model, so it depends on x_i (an aggregation round's
Δx_i = ηλ(x̄ − x_i) gives x_i away outright); x_i itself is declared state (``x.``). Frozen parameters are
neither uploaded nor kept in x_i.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import ClientUpdate, PersonalModels
from fl_lightning.client import Client, Params, make_generator
from fl_lightning.errors import ConfigError

LOCAL = "x."
DELTA = "delta_x."


class L2GD(PersonalModels):
    local_prefix, delta_prefix = LOCAL, DELTA
    vectorizable = True  # ctx.sgd, ctx.mean_loss and dict operations
    state_prefixes = (LOCAL,)
    reveals = (
        "Δx_i, the change of the client's personal model x_i (an aggregation round's ηλ(x̄ − x_i) gives x_i itself)"
    )
    state_dependent_uploads = (DELTA,)
    needs_uniform_aggregation = True

    def __init__(self, p: float = 0.9, alpha: float = 0.25, lam: float = 1.0, local_epochs: int = 1) -> None:
        super().__init__()
        if not 0 < p < 1:
            raise ConfigError(f"L2GD p must be in (0, 1), got {p}")
        self.p, self.alpha, self.lam, self.local_epochs = p, alpha, lam, local_epochs
        self.num_clients = 0

    @property
    def local_training_rate(self) -> float:  # type: ignore[override]
        """A round trains locally (ξ = 0) with probability 1 − p."""
        return 1 - self.p

    @property
    def mixing(self) -> float:
        """ηλ with η = α / (N(1−p)) (spec 000 §8.2)."""
        return self.alpha * self.lam / (self.num_clients * (1 - self.p))

    def aggregation_round(self, seed: int, round_idx: int) -> bool:
        return bool(torch.rand((), generator=make_generator(seed, "l2gd", round_idx)) < self.p)

    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        if not 0 <= self.mixing <= 1:
            raise ConfigError(
                f"L2GD: the aggregation step ηλ = αλ/(N(1−p)) = {self.mixing:.3g} must be in [0, 1]; lower alpha or lam"
            )

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        x = self.client_model(global_params, state)
        if self.aggregation_round(ctx.seed, ctx.round):
            a = self.mixing
            new = {n: (1 - a) * t + a * global_params[n] if t.is_floating_point() else t for n, t in x.items()}
            loss = ctx.mean_loss(new)
        else:
            new = ctx.sgd(x, ctx.param_names, self.local_epochs)
            loss = ctx.train_loss
        return self.personal_update(ctx, x, new, loss)
