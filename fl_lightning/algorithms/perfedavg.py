"""Per-FedAvg (Fallah et al., 2020), Hessian-free version, as configured in FedRep (spec 000 §2.4).

Each sampled client runs ``local_epochs`` epochs of meta-steps from the global model w. A meta-step
draws ``support`` + ``target`` samples (8 + 2), splits them into D and D', and steps along

    g = ∇f(w̃; D') − α·[∇f(w + δg', D) − ∇f(w − δg', D)] / (2δ),   w̃ = w − α∇f(w; D),  g' = ∇f(w̃; D'),

(Fallah et al., Per-FedAvg (HF): the Hessian-vector product ∇²f(w)·g' by a central difference, here on
D, since only 8 + 2 samples are drawn), using the run's SGD settings (lr β = 0.01, momentum, weight decay,
``decay_bias``). Each epoch shuffles the client's data into batches of 8 + 2: the first ``support`` samples of a
batch are D, the rest D'; a last batch with no target sample is skipped. A straggler stops after its share of
the meta-steps. The first-order variant drops the bracket. α = ``inner_lr`` = 1e-4. The client uploads w (FedAvg
aggregation; frozen parameters are not uploaded); Per-FedAvg keeps no client state.

The meta-step is a ``Gradient`` for ``ctx.sgd`` (batches of 8 + 2, those without a target sample skipped), so
both executors run it; the logged training loss is the meta-objective f(w̃; D') at each step.

Evaluation adapts the meta-model first: ``adapt_steps`` full-batch gradient steps of size ``adapt_lr``
(default α) on the client's training data, w_i = w − α∇f_i(w) for one step (Fallah et al. eq. 3). The paper's
value is that default: spec 000 does not state the evaluation step (§2.4 [NS]).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.func import grad, grad_and_value

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Gradient, Params
from fl_lightning.errors import ConfigError


class PerFedAvg(Algorithm):
    vectorizable = True  # ctx.sgd with a Gradient and dict operations
    reveals = "the meta-model after local meta-steps on the client's data; no client state exists"

    def __init__(
        self,
        inner_lr: float = 1e-4,
        support: int = 8,
        target: int = 2,
        local_epochs: int = 1,
        first_order: bool = False,
        hvp_delta: float = 1e-3,
        adapt_lr: float | None = None,
        adapt_steps: int = 1,
    ) -> None:
        super().__init__()
        if support < 1 or target < 1:
            raise ConfigError(f"PerFedAvg needs support ≥ 1 and target ≥ 1, got {support} and {target}")
        self.inner_lr, self.support, self.target, self.local_epochs = inner_lr, support, target, local_epochs
        self.first_order, self.hvp_delta = first_order, hvp_delta
        self.adapt_lr = inner_lr if adapt_lr is None else adapt_lr
        self.adapt_steps = adapt_steps

    def meta_gradient(self, ctx: Client, w: Params, names: list[str], support, target) -> dict:
        """The HF (or first-order) Per-FedAvg gradient at w for one (D, D') pair of ``(x, y)`` batches."""
        return self.meta_step(ctx, w, names, (*support, None), (*target, None))[0]

    def meta_step(self, ctx: Client, w: Params, names: Sequence[str], support, target) -> tuple[Params, Tensor]:
        """(the meta-gradient at w, f(w̃; D')) for ``(x, y, mask)`` batches D and D' (``mask``: real rows)."""

        def loss_on(batch):
            x, y, mask = batch
            return lambda q: ctx.batch_loss({**w, **q}, x, y, mask)

        theta = {n: w[n] for n in names}
        g_in = grad(loss_on(support))(theta)
        g_out, loss = grad_and_value(loss_on(target))({n: theta[n] - self.inner_lr * g_in[n] for n in names})
        if self.first_order:
            return g_out, loss
        d = self.hvp_delta
        plus = grad(loss_on(support))({n: theta[n] + d * g_out[n] for n in names})
        minus = grad(loss_on(support))({n: theta[n] - d * g_out[n] for n in names})
        return {n: g_out[n] - self.inner_lr * (plus[n] - minus[n]) / (2 * d) for n in names}, loss

    def meta_gradients(self, ctx: Client, names: Sequence[str]) -> Gradient:
        """A batch of ``support + target`` samples → the meta-step on D = its first ``support`` rows, D' = the rest."""
        s = self.support

        def gradient(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Params, Tensor]:
            return self.meta_step(ctx, params, names, (x[:s], y[:s], mask[:s]), (x[s:], y[s:], mask[s:]))

        return gradient

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        names = ctx.param_names
        size = self.support + self.target
        w = ctx.sgd(
            dict(global_params),
            names,
            self.local_epochs,
            gradient=self.meta_gradients(ctx, names),
            batch_size=size,
            min_batch=self.support + 1,
        )
        upload = {n: w[n] for n in self.trained_names(w)}
        return ClientUpdate(upload, {}, ctx.num_samples, loss=ctx.train_loss)

    def adapt_for_evaluation(self, ctx: Client, params: Params) -> Params:
        """``adapt_steps`` full-batch gradient steps w ← w − α∇f_i(w) on the client's training data (a client
        without data keeps w)."""
        names = ctx.param_names
        for _ in range(self.adapt_steps):
            g = ctx.full_gradient(params, names)
            params = {**params, **{n: (params[n] - self.adapt_lr * g[n]).detach() for n in names}}
        return params
