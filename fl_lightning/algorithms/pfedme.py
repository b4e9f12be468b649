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

Choices where the paper leaves one open: only the sampled clients train (Algorithm 1 lets all N clients train and
aggregates S of them; the others' θ_i here keep the value of their last round); each round's first personal
solve starts from θ = w^t and later ones warm-start from the previous θ̃ (the starting point of the inner
solver is not fixed by the paper); a straggler runs its share of the R local rounds.

Privacy: w is computed from w^t and the client's data only (θ_i from earlier rounds is never read), so the
upload does not depend on θ_i, bit for bit; θ_i is declared state (``theta.``) and never uploaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import ClientContext, Params, load_state, save_state
from fl_lightning.errors import ConfigError

PERSONAL = "theta."


def endless_batches(ctx: ClientContext) -> Iterator[tuple[Tensor, Tensor]]:
    """The client's shuffled minibatches, epoch after epoch (each epoch reshuffled with the client's generator)."""
    while True:
        yield from ctx.batches()


class PFedMe(Algorithm):
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

    def rounds_for(self, ctx: ClientContext) -> int:
        """R, or a straggler's share of it (at least one); none without data."""
        if ctx.num_samples == 0:
            return 0
        return self.local_steps if ctx.step_budget >= 1 else max(1, int(ctx.step_budget * self.local_steps))

    def personal_solve(
        self, ctx: ClientContext, theta: Params, w: Params, x: Tensor, y: Tensor
    ) -> tuple[Params, float]:
        """K gradient steps on f_i(θ; D) + λ/2‖θ − w‖² from ``theta`` (trainable names only); the mean f_i seen."""
        names, loss_sum = list(theta), 0.0
        for _ in range(self.inner_steps):
            leaves = {n: theta[n].detach().requires_grad_(True) for n in names}
            loss = ctx.loss({**w, **leaves}, x, y)
            proximal = 0.5 * self.lam * sum(((leaves[n] - w[n]) ** 2).sum() for n in names)
            grads = torch.autograd.grad(loss + proximal, [leaves[n] for n in names])
            theta = {n: (leaves[n] - self.personal_lr * g).detach() for n, g in zip(names, grads)}
            loss_sum += float(loss.detach())
        return theta, loss_sum / self.inner_steps

    def client_update(self, ctx: ClientContext, global_params: Params, state: Params) -> ClientUpdate:
        names = ctx.param_names
        w = {n: t.detach().clone() for n, t in global_params.items()}
        leaves = {n: w[n].requires_grad_(True) for n in names}
        theta = {n: w[n].detach().clone() for n in names}
        opt = ctx.optimizer.build(leaves)
        if ctx.optimizer_state is not None:
            load_state(opt, leaves, ctx.optimizer_state)
        rounds, loss_sum = self.rounds_for(ctx), 0.0
        batches = endless_batches(ctx)
        for _ in range(rounds):
            x, y = next(batches)
            anchor = {n: t.detach() for n, t in w.items()}
            theta, loss = self.personal_solve(ctx, theta, anchor, x, y)
            for n in names:  # ∇F_i(w) = λ(w − θ̃)
                leaves[n].grad = self.lam * (anchor[n] - theta[n])
            opt.step()
            loss_sum += loss
        ctx.train_loss = loss_sum / max(rounds, 1)
        if ctx.optimizer_state is not None:
            ctx.optimizer_state = save_state(opt, leaves, ctx.optimizer_state, rounds)
        w = {n: t.detach() for n, t in w.items()}
        return ClientUpdate(
            upload={n: w[n] for n in self.trained_names(w)},
            state={PERSONAL + n: theta.get(n, w[n]) for n in self.trained_names(w)},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )
