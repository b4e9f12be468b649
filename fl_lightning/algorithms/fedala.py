"""FedALA (J. Zhang et al., AAAI 2023, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning").

Each client keeps its local model θ_i. When it receives the global model Θ, its Adaptive Local Aggregation (ALA)
module initialises the model it trains element-wise (the paper's eq. for θ̂_i):

    θ̂_i = θ_i + (Θ − θ_i) ⊙ W_i    on the top ``p`` layers,      θ̂_i = Θ    on the layers below,

with aggregation weights W_i ∈ [0, 1] (same shapes as those layers, all ones at the start, kept per client in the
bank). W_i is learned on a random ``s`` % of the client's training data by gradient descent on the loss of θ̂_i,
each step followed by clipping to [0, 1]:

    W_i ← clip(W_i − η ∇_{W_i} L(θ̂_i), 0, 1),    ∇_{W_i} L = ∇_{θ̂_i} L ⊙ (Θ − θ_i),

in minibatches of the run's batch size. The first time a client has a local model to mix (its second round),
W_i is trained until the loss settles (the standard deviation of the last ``window`` minibatch losses below
``threshold``, at most ``init_max_epochs`` epochs); later, one epoch over the s % sample. Then the client trains
θ̂_i with local SGD for ``local_epochs`` epochs; the result is its new θ_i (only the top p layers need keeping:
the others are replaced by Θ next time) and its upload (FedAvg aggregation). In a client's first round there is no
local model yet: θ̂_i = Θ (ALA would not move it).

Defaults: s = 80, η = 1.0 and ALA on the head (the authors' run script: ``-rp 80 -et 1`` and its last two
parameter tensors, the head's weight and bias, which is p = 1 here); the convergence rule's ``threshold = 0.1``
and ``window = 10`` are the defaults of the authors' released ALA module. Choices made here: a "layer" is a module
with trainable parameters (a Linear's weight and bias together; BatchNorm statistics come from Θ), the cap
``init_max_epochs`` on the first ALA, and no augmentation in the ALA passes. A client is evaluated with the model
ALA would give it now with its current W_i (θ̂_i from the current Θ; W_i is learned only when the client trains).

Privacy: θ̂_i is built from θ_i and W_i, so every upload depends on them; both stay in the bank (``local.``,
``ala_w.``, ``ala_runs``).

Executors: FedALA runs client by client (not ``vectorizable``). Its local training is one ``ctx.sgd`` phase, but
learning W_i is outside the client contract in three ways: W_i takes plain projected gradient steps
(``clip(W − η∇, 0, 1)``, not a step of the client optimiser, whose momentum and weight decay ``sgd`` would apply),
on a random s % subset of the client's data with shuffles of its own (``sgd`` walks epochs over all of it), and the
first ALA of a client stops when its loss has settled (a per-client, data-dependent number of epochs decided on the
host from the losses); the branch on ``ala_runs`` (no ALA, ALA until settled, one epoch) also differs per client.
"""

from __future__ import annotations

import torch

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import LoopClient, Params
from fl_lightning.errors import ConfigError

LOCAL = "local."
WEIGHTS = "ala_w."
#: rounds the client has trained (0: no local model yet; 1: its next ALA runs until the loss settles)
RUNS = "ala_runs"
STATISTICS = ("running_mean", "running_var")


class FedALA(Algorithm):
    state_prefixes = (LOCAL, WEIGHTS, RUNS)
    reveals = (
        "the model trained from the client's ALA initialisation θ_i + (Θ − θ_i) ⊙ W_i: its update depends on the "
        "client's local model θ_i and aggregation weights W_i (never sent)"
    )
    state_dependent_uploads = ("",)

    def __init__(
        self,
        local_epochs: int = 1,
        p: int = 1,
        s: float = 80.0,
        eta: float = 1.0,
        threshold: float = 0.1,
        window: int = 10,
        init_max_epochs: int = 50,
    ) -> None:
        super().__init__()
        if p < 1 or not 0 < s <= 100 or eta <= 0 or window < 2 or init_max_epochs < 1:
            raise ConfigError(
                f"FedALA needs p ≥ 1, 0 < s ≤ 100, eta > 0, window ≥ 2 and init_max_epochs ≥ 1; got p={p}, s={s}, "
                f"eta={eta}, window={window}, init_max_epochs={init_max_epochs}"
            )
        self.local_epochs, self.p, self.s, self.eta = local_epochs, p, s, eta
        self.threshold, self.window, self.init_max_epochs = threshold, window, init_max_epochs

    # ---- which tensors ALA mixes ----------------------------------------------------------------------------
    def layers(self, params: Params) -> dict[str, list[str]]:
        """Trainable tensors grouped by layer (module path), bottom to top, BatchNorm statistics left out."""
        out: dict[str, list[str]] = {}
        for n in self.trained_names(params):
            if params[n].is_floating_point() and not n.endswith(STATISTICS):
                out.setdefault(n.rsplit(".", 1)[0], []).append(n)
        return out

    def top_names(self, params: Params) -> list[str]:
        """The tensors of the top ``p`` layers (where ALA learns W)."""
        return [n for names in list(self.layers(params).values())[-self.p :] for n in names]

    def setup(self, global_params: Params, num_clients: int) -> None:
        layers = self.layers(global_params)
        if self.p > len(layers):
            raise ConfigError(
                f"FedALA: p = {self.p} top layers for adaptive aggregation, but the network has {len(layers)} layers "
                f"with trained parameters ({', '.join(layers)}); set model.algorithm.init_args.p ≤ {len(layers)}"
            )

    def init_client_state(self, global_params: Params) -> Params:
        top = self.top_names(global_params)
        state = {LOCAL + n: global_params[n] for n in top}
        state.update({WEIGHTS + n: torch.ones_like(global_params[n]) for n in top})
        state[RUNS] = torch.zeros((), dtype=torch.long, device=global_params[top[0]].device)
        return state

    # ---- ALA ---------------------------------------------------------------------------------------------------
    @staticmethod
    def mix(local: Params, global_params: Params, weights: Params) -> Params:
        """θ + (Θ − θ) ⊙ W for every tensor of ``weights``."""
        return {n: local[n] + (global_params[n] - local[n]) * w for n, w in weights.items()}

    def client_model(self, global_params: Params, state: Params) -> Params:
        top = self.top_names(global_params)
        local = {n: state[LOCAL + n] for n in top}
        mixed = self.mix(local, global_params, {n: state[WEIGHTS + n] for n in top})
        started = state[RUNS] > 0
        return {**global_params, **{n: torch.where(started, mixed[n], global_params[n]) for n in top}}

    def learn_weights(
        self, ctx: LoopClient, global_params: Params, local: Params, weights: Params, until_converged: bool
    ) -> Params:
        """W_i by clipped gradient descent on the loss of θ̂_i over a random s % of the client's data."""
        n = ctx.num_samples
        if n == 0:
            return weights
        sample = torch.randperm(n, generator=ctx.generator)[: max(1, int(self.s / 100 * n))].to(ctx.x.device)
        x, y = ctx.x[sample], ctx.y[sample]
        gap = {k: (global_params[k] - local[k]).detach() for k in weights}
        base = {k: v.detach().clone() for k, v in global_params.items()}  # a scratch copy (BN statistics move)
        weights = {k: w.clone() for k, w in weights.items()}
        losses: list[float] = []
        bs = ctx.optimizer.batch_size
        for _ in range(self.init_max_epochs if until_converged else 1):
            perm = torch.randperm(x.shape[0], generator=ctx.generator).to(x.device)
            for i in range(0, x.shape[0], bs):
                idx = perm[i : i + bs]
                mixed = {k: v.detach().requires_grad_(True) for k, v in self.mix(local, global_params, weights).items()}
                loss = ctx.loss({**base, **mixed}, x[idx], y[idx])
                grads = torch.autograd.grad(loss, list(mixed.values()))
                for (k, w), g in zip(weights.items(), grads):
                    weights[k] = (w - self.eta * g * gap[k]).clamp(0.0, 1.0)
                losses.append(float(loss.detach()))
            if until_converged and settled(losses, self.window, self.threshold):
                break
        return weights

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        top = self.top_names(global_params)
        runs = int(state[RUNS])
        weights = {n: state[WEIGHTS + n] for n in top}
        if runs == 0:  # no local model yet: start from the global one
            start = dict(global_params)
        else:
            local = {n: state[LOCAL + n] for n in top}
            weights = self.learn_weights(ctx, global_params, local, weights, until_converged=runs == 1)
            start = {**global_params, **self.mix(local, global_params, weights)}
        params = ctx.sgd(start, ctx.param_names, self.local_epochs)
        new_state = {LOCAL + n: params[n] for n in top}
        new_state.update({WEIGHTS + n: w for n, w in weights.items()})
        new_state[RUNS] = state[RUNS] + 1
        upload = {n: params[n] for n in self.trained_names(params)}
        return ClientUpdate(upload, new_state, ctx.num_samples, loss=ctx.train_loss)


def settled(losses: list[float], window: int, threshold: float) -> bool:
    """Whether the last ``window`` losses have a standard deviation below ``threshold`` (ALA's first training)."""
    return len(losses) >= window and float(torch.tensor(losses[-window:]).std()) < threshold
