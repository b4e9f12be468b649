"""APFL (Deng et al., 2020, Algorithm 1 with a fixed α; spec 000 §2.4).

Each sampled client keeps a local model v_i (client bank) and, on every minibatch ξ, takes one SGD step
on its copy of the global model, w ← w − η∇f_i(w; ξ), and one on the local model through the mixture,
v ← v − η∇_v f_i(αv + (1−α)w; ξ), both at the pre-step (w, v). After ``local_epochs`` epochs it uploads
w. Its personal model is αv_i + (1−α)w, with the current global w. α = 0.25 (spec 000 §2.4; the α of the
two most heterogeneous CIFAR columns is not stated).

Both steps are one step of the client optimiser (the run's local SGD: momentum, weight decay, ``decay_bias``)
over w and v together, whose step direction (``gradients``) is (∇_w f(w), ∇_v f(αv + (1−α)w)) on the same
minibatch; a straggler stops both after its share of the minibatch steps. Written as a ``Gradient`` for
``ctx.sgd``, it runs in both executors. Privacy: w's steps never read v, so the upload does not depend on v_i (bit
for bit); v_i is declared state (``v.``). Frozen parameters are neither uploaded nor copied into v_i.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.func import grad, grad_and_value

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Gradient, Params
from fl_lightning.errors import ConfigError

LOCAL = "v."


def mix(alpha: float, v: Params, w: Params) -> Params:
    """αv + (1−α)w, name by name (w where v has no entry: frozen parameters; integer buffers)."""
    return {n: alpha * v[n] + (1 - alpha) * t if n in v and t.is_floating_point() else t for n, t in w.items()}


class APFL(Algorithm):
    vectorizable = True  # ctx.sgd with a Gradient and dict operations
    state_prefixes = (LOCAL,)
    reveals = "the local SGD update of the global model w on the client's data; nothing of its local model v_i"

    def __init__(self, alpha: float = 0.25, local_epochs: int = 1) -> None:
        super().__init__()
        if not 0 <= alpha <= 1:
            raise ConfigError(f"APFL alpha must be in [0, 1], got {alpha}")
        self.alpha, self.local_epochs = alpha, local_epochs

    def init_client_state(self, global_params: Params) -> Params:
        return {LOCAL + n: global_params[n] for n in self.trained_names(global_params)}

    def local_model(self, global_params: Params, state: Params) -> Params:
        return {n: state[LOCAL + n] for n in global_params if LOCAL + n in state}

    def client_model(self, global_params: Params, state: Params) -> Params:
        return mix(self.alpha, self.local_model(global_params, state), global_params)

    def gradients(self, ctx: Client, names: Sequence[str]) -> Gradient:
        """One minibatch's step direction for (w, v), both at the pre-step values: ∇_w f(w) and
        ∇_v f(αv + (1−α)w) (w held fixed in the mixture); the step's loss is the mixed model's."""

        def gradient(params: Params, x: Tensor, y: Tensor, mask: Tensor) -> tuple[Params, Tensor]:
            w = {n: t for n, t in params.items() if not n.startswith(LOCAL)}
            v = {n[len(LOCAL) :]: t for n, t in params.items() if n.startswith(LOCAL)}
            g_w = grad(lambda q: ctx.batch_loss({**w, **q}, x, y, mask))({n: w[n] for n in names})
            g_v, mixed_loss = grad_and_value(lambda q: ctx.batch_loss(mix(self.alpha, {**v, **q}, w), x, y, mask))(
                {n: v[n] for n in names}
            )
            return {**g_w, **{LOCAL + n: g for n, g in g_v.items()}}, mixed_loss

        return gradient

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        names = ctx.param_names
        local = self.local_model(global_params, state)
        params = {**global_params, **{LOCAL + n: t for n, t in local.items()}}
        trained = [*names, *(LOCAL + n for n in names)]
        out = ctx.sgd(params, trained, self.local_epochs, gradient=self.gradients(ctx, names))
        w = {n: out[n] for n in global_params}
        return ClientUpdate(
            upload={n: w[n] for n in self.trained_names(w)},
            state={LOCAL + n: out[LOCAL + n] for n in local},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )
