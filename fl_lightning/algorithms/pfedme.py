"""pFedMe (Dinh et al., NeurIPS 2020, §3 and Algorithm 1): personalised models through Moreau envelopes.

The problem is bi-level: min_w (1/N) Σ_i F_i(w) with F_i(w) = min_θ { f_i(θ) + λ/2‖θ − w‖² } (the Moreau envelope of
f_i), whose gradient is ∇F_i(w) = λ(w − θ̂_i(w)) with θ̂_i(w) the personal model that attains the min.

A sampled client starts its local model at the global model, w ← w^t, and runs R local rounds. Each draws a
minibatch D (|D| = the run's batch size) and

1. solves the personal problem θ̃ ≈ argmin_θ f_i(θ; D) + λ/2‖θ − w‖² with K steps of gradient descent at the
   personal learning rate (``personal_lr``);
2. steps the local model along the envelope's gradient, w ← w − ηλ(w − θ̃), with η the run's client learning
   rate (``model.lr``) through the client optimiser (plain SGD in the paper: the configs set momentum 0).

It uploads w and keeps the last θ̃ as its personal model θ_i (client bank, ``theta.``), which it is evaluated
with. The server mixes, w^{t+1} = (1 − β)w^t + β·mean_S w_i: that is the engine's server step with ``server_lr``
= β (β = 1 in the configs, the paper's comparison setting).

Both steps are one ``ctx.sgd`` phase of R steps (``max_steps``, a straggler's share per client) whose ``Gradient``
solves the personal problem with ``torch.func`` and hands θ̃ on to the next step (the values a step sets), so
pFedMe runs on both executors.

Choices where the paper leaves one open: only the sampled clients train (Algorithm 1 lets all N clients train and
aggregates S of them; the others' θ_i here keep the value of their last round); each round's first personal
solve starts from θ = w^t and later ones warm-start from the previous θ̃ (the starting point of the inner
solver is not fixed by the paper); a straggler runs its share of the R local rounds.

Privacy: w is computed from w^t and the client's data only (θ_i from earlier rounds is never read), so the
upload does not depend on θ_i, bit for bit; θ_i is declared state (``theta.``) and never uploaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Params
from fl_lightning.errors import ConfigError

PERSONAL = "theta."


class PFedMe(Algorithm):
    vectorizable = True  # ctx.sgd with a Gradient (the personal solve) that carries θ̃ from step to step
    state_prefixes = (PERSONAL,)
    reveals = "the local model w after R Moreau-envelope steps from the global model; nothing of the personal model θ_i"

    def __init__(
        self,
        lam: float = 15.0,
        personal_lr: float = 0.09,
        inner_steps: int = 5,
        local_steps: int = 20,
    ) -> None:
        super().__init__()
        if lam <= 0 or personal_lr <= 0 or inner_steps < 1 or local_steps < 1:
            raise ConfigError(
                f"PFedMe needs lam > 0, personal_lr > 0, inner_steps ≥ 1 and local_steps ≥ 1, got {lam}, "
                f"{personal_lr}, {inner_steps}, {local_steps}"
            )
        self.lam, self.personal_lr = lam, personal_lr
        self.inner_steps, self.local_steps = inner_steps, local_steps

    def init_client_state(self, global_params: Params) -> Params:
        return {PERSONAL + n: global_params[n] for n in self.trained_names(global_params)}

    def client_model(self, global_params: Params, state: Params) -> Params:
        return {n: state.get(PERSONAL + n, t) for n, t in global_params.items()}

    def rounds_for(self, num_samples: int, step_budget: float) -> int:
        """R, or a straggler's share of it (at least one); none without data."""
        if num_samples == 0:
            return 0
        return self.local_steps if step_budget >= 1 else max(1, int(step_budget * self.local_steps))

    def personal_solve(
        self, ctx: Client, theta: Params, w: Params, x: Tensor, y: Tensor, mask: Tensor
    ) -> tuple[Params, Tensor]:
        """K gradient steps on f_i(θ; D) + λ/2‖θ − w‖² from ``theta`` (trainable names only); the mean f_i seen."""
        loss_sum = torch.zeros((), device=x.device)

        def objective(q: Params) -> tuple[Tensor, Tensor]:
            loss = ctx.batch_loss({**w, **q}, x, y, mask)
            proximal = 0.5 * self.lam * sum(((q[n] - w[n]) ** 2).sum() for n in q)
            return loss + proximal, loss

        for _ in range(self.inner_steps):
            grads, loss = torch.func.grad(objective, has_aux=True)(theta)
            theta = {n: theta[n] - self.personal_lr * grads[n] for n in theta}
            loss_sum = loss_sum + loss.detach()
        return theta, loss_sum / self.inner_steps

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        """R steps of the client optimiser along λ(w − θ̃), each on one minibatch (epoch after epoch, reshuffled):
        ``ctx.sgd`` with a ``Gradient`` that solves the personal problem and carries θ̃ to the next step."""
        names = ctx.param_names
        start = {PERSONAL + n: global_params[n] for n in names}  # the first personal solve starts from w^t

        def envelope_gradient(values: Params, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Params, Tensor, Params]:
            w = {n: v for n, v in values.items() if not n.startswith(PERSONAL)}
            theta, loss = self.personal_solve(ctx, {n: values[PERSONAL + n] for n in names}, w, x, y, mask)
            grads = {n: self.lam * (w[n] - theta[n]) for n in names}  # ∇F_i(w) = λ(w − θ̃)
            return grads, loss, {PERSONAL + n: theta[n] for n in names}

        params = ctx.sgd(
            {**global_params, **start}, names, self.local_steps, max_steps=self.rounds_for, gradient=envelope_gradient
        )
        w = {n: params[n] for n in global_params}
        return ClientUpdate(
            upload={n: w[n] for n in self.trained_names(w)},
            state={PERSONAL + n: params[PERSONAL + n] if n in names else w[n] for n in self.trained_names(w)},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )
