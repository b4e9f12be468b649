"""FedDyn (Acar et al., ICLR 2021, Algorithm 1): federated learning with dynamic regularisation.

Each client keeps g_i = ∇L_i(θ_i^{t−1}), the gradient of its loss at its last local model (client bank, ``grad.``;
zero before its first round); the server keeps h (zero at first). A sampled client starts from the global model
θ^{t−1} and minimises, with ``local_epochs`` epochs of local SGD (the run's client optimiser),

    L_i(θ) − ⟨g_i, θ⟩ + α/2‖θ − θ^{t−1}‖²,

then updates its state from the first-order condition of that problem, g_i ← g_i − α(θ_i^t − θ^{t−1}), and
uploads Δθ_i = θ_i^t − θ^{t−1}. With m the number of clients and P the round's uploads, the server sets

    h ← h − α·(1/m)·Σ_{i∈P} Δθ_i,        θ^t = (1/|P|)·Σ_{i∈P} θ_i^t − h/α = θ^{t−1} + mean_P Δθ_i − h/α.

The linear and proximal terms are one ``Penalty`` with the client's g_i and θ^{t−1} as its per-client data and its
gradient −g_i + α(θ − θ^{t−1}) in closed form (no autograd pass through it), so FedDyn runs on both executors.

The server math is FedDyn's own (``server_update``): ``model.server_lr`` and server optimisers do not apply, and
the plain mean over P needs ``model.aggregation: uniform`` (checked). |P| is the number of uploads the engine
aggregated. Buffers (BatchNorm statistics) are averaged without h; frozen parameters are neither regularised nor
uploaded. α = 0.01, the value of the paper's experiments (chosen there from {0.1, 0.01, 0.001}).

Privacy: Δθ_i is trained with the linear term ⟨g_i, θ⟩, so it depends on the client's g_i (declared); g_i itself
is declared state (``grad.``) and never uploaded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate, RoundFacts
from fl_lightning.client import Client, Params, Penalty
from fl_lightning.errors import ConfigError

STATE = "grad."
DELTA = "delta."


def _key(name: str) -> str:
    return "h__" + name.replace(".", "__")


class FedDyn(Algorithm):
    vectorizable = True  # ctx.sgd with a Penalty (its linear and proximal terms, gradient in closed form)
    state_prefixes = (STATE,)
    reveals = "Δθ_i, the local model's change, trained with the client's linear term ⟨g_i, θ⟩ (g_i is never sent)"
    state_dependent_uploads = (DELTA,)
    needs_uniform_aggregation = True

    def __init__(self, alpha: float = 0.01, local_epochs: int = 1) -> None:
        super().__init__()
        if alpha <= 0:
            raise ConfigError(f"FedDyn alpha must be > 0, got {alpha}")
        self.alpha, self.local_epochs = alpha, local_epochs
        self.num_clients = 0
        self.buffer_names: frozenset[str] = frozenset()  #: the network's buffers (no dynamic regulariser)
        self.names: list[str] = []  #: the regularised parameters: trained, floating, not buffers

    # -- server state ------------------------------------------------------------------------------------------
    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        self.buffer_names = frozenset(n for n, _ in net.named_buffers())

    def uploaded_names(self, params: Params) -> list[str]:
        return [n for n in self.trained_names(params) if params[n].is_floating_point()]

    def setup(self, global_params: Params, num_clients: int) -> None:
        self.num_clients = num_clients
        self.names = [n for n in self.uploaded_names(global_params) if n not in self.buffer_names]
        for n in self.names:
            if not hasattr(self, _key(n)):
                self.register_buffer(_key(n), torch.zeros_like(global_params[n]))

    def server_state(self) -> Params:
        """h, by parameter name."""
        return {n: getattr(self, _key(n)) for n in self.names}

    def init_client_state(self, global_params: Params) -> Params:
        return {STATE + n: torch.zeros_like(global_params[n]) for n in self.names}

    def upload_template(self, global_params: Params) -> Params:
        return {DELTA + n: global_params[n] for n in self.uploaded_names(global_params)}

    def download_template(self, global_params: Params) -> Params:
        return {n: global_params[n] for n in self.trained_names(global_params)}

    # -- client and server math --------------------------------------------------------------------------------
    def dynamic_regulariser(self, params: Params, data: Params) -> Tensor:
        """−⟨g_i, θ⟩ + α/2‖θ − θ^{t−1}‖² (``data``: ``grad.<name>`` = g_i, ``<name>`` = θ^{t−1})."""
        names = [n for n in data if not n.startswith(STATE)]
        linear = sum((params[n] * data[STATE + n]).sum() for n in names)
        return -linear + 0.5 * self.alpha * sum(((params[n] - data[n]) ** 2).sum() for n in names)

    def regulariser_gradient(self, params: Params, data: Params) -> Params:
        """Its gradient in closed form: −g_i + α(θ − θ^{t−1}) (no autograd pass through the term)."""
        return {n: self.alpha * (params[n] - data[n]) - data[STATE + n] for n in data if not n.startswith(STATE)}

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        names = [n for n in ctx.param_names if STATE + n in state]
        data = {n: global_params[n].detach() for n in names}
        data.update({STATE + n: state[STATE + n].detach() for n in names})
        penalty = Penalty(self.dynamic_regulariser, data, self.regulariser_gradient)
        params = ctx.sgd(dict(global_params), ctx.param_names, self.local_epochs, penalty=penalty)
        upload = {DELTA + n: params[n] - global_params[n] for n in self.uploaded_names(params)}
        new_state = dict(state)
        for n in names:  # g_i ← g_i − α(θ_i − θ^{t−1}), with the uploaded θ_i − θ^{t−1}
            new_state[STATE + n] = state[STATE + n] - self.alpha * upload[DELTA + n]
        return ClientUpdate(upload, new_state, ctx.num_samples, loss=ctx.train_loss)

    @torch.no_grad()
    def server_update(self, global_params: Params, averaged_extra: Params, facts: RoundFacts) -> None:
        h, share = self.server_state(), facts.num_aggregated / self.num_clients
        for n, t in global_params.items():
            if DELTA + n not in averaged_extra:
                continue
            delta = averaged_extra[DELTA + n].to(t.dtype)
            if n in h:
                h[n].sub_(self.alpha * share * delta)
                t.add_(delta - h[n] / self.alpha)
            else:
                t.add_(delta)
