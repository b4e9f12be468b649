"""FedRoD (H.-Y. Chen and W.-L. Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning"): a
generic head trained with the balanced softmax loss, plus a personal head on top of it.

The network's body f(·; θ) and its (generic) head h_G(·; ψ) are shared: each sampled client trains them with the
balanced softmax (BSM) loss (§4.1; Ren et al. 2020), the cross entropy of the logits shifted by the log of the
client's class prior,

    ℓ_BSM(x, y) = −log softmax(h_G(z) + log π_i)_y,   z = f(x; θ),   π_{i,c} = N_{i,c} / N_i,

so that a client's label skew does not bias the generic model (classes absent on the client, π = 0, get no
gradient). The personal head h_P(·; φ_i) lives in the client bank (``p_head.``); the client's personalised
prediction adds the two heads' logits, ŷ = h_G(z) + h_P(z) (§4.2), and φ_i is trained with the plain cross entropy
of that sum on the client's data, through detached features and a detached generic output (the personal loss
moves neither θ nor ψ):

    ℓ_P(x, y) = −log softmax(h_G(z).detach() + h_P(z.detach()))_y.

Per minibatch both losses are computed from the same forward pass and both parameter sets take one step of the
run's client optimiser (momentum SGD unless ``model.client_optimizer`` says otherwise), for ``local_epochs``
epochs: one ``ctx.sgd`` phase over θ, ψ and φ_i whose ``Objective`` is ℓ_BSM + ℓ_P (ℓ_P's inputs detached, so θ, ψ
get ℓ_BSM's gradient and φ_i ℓ_P's; the optimisers' updates are per parameter, so one optimiser over both sets
steps as two would). It runs on both executors; with ``model.keep_client_optimizer_state`` θ and ψ continue
from their kept state, φ_i starts fresh each round. The client uploads θ and ψ (FedAvg aggregation). Choices the
paper leaves open, made here: φ_i starts at zero (a client's first personal prediction is the generic one), and
both steps happen at the same minibatch (simultaneously, from the pre-step parameters). The paper's hypernetwork
variant of the personal head is not implemented.

Since h_G and h_P are linear, h_G(z) + h_P(z) is the linear head with weight W_G + W_P and bias b_G + b_P: that is
the model a client is evaluated with (``client_model``), so FedRoD needs a one-layer linear classifier ``head``.

Privacy: the uploaded θ, ψ never read φ_i (bit for bit); they are trained with the client's class prior π_i, which
they reveal to the extent that a BSM update does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import Client, Objective, Params
from fl_lightning.errors import ConfigError

PERSONAL = "p_head."
HEAD = ("head.weight", "head.bias")


def log_prior(y: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """log π_c = log(N_c / N) of the client's labels (−inf for a class it does not have)."""
    return prior_shift(torch.bincount(y, minlength=num_classes).to(dtype))


def prior_shift(counts: Tensor) -> Tensor:
    """log π_c from per-class counts ``[..., C]`` (one client, or stacked clients)."""
    return counts.log() - counts.sum(-1, keepdim=True).clamp(min=1).log()


def features(ctx: Client, params: Params, x: Tensor) -> Tensor:
    """z: the body's output (through the side-information branch when the network has one)."""
    net = ctx.net
    z = functional_call(net.body, _under(params, "body."), (x,))
    if getattr(net, "side", None) is not None:
        z = functional_call(net.side, _under(params, "side."), (z, ctx.side_for(x.shape[0])))
    return z


def _under(params: Params, prefix: str) -> Params:
    return {n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}


class FedRoD(Algorithm):
    vectorizable = True  # ctx.sgd with an Objective (both heads' losses from one forward pass)
    state_prefixes = (PERSONAL,)
    reveals = (
        "the body and generic head after local SGD with the balanced softmax loss (shifted by the client's log "
        "class prior); nothing of its personal head"
    )

    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__()
        self.local_epochs = local_epochs
        self.head_names: tuple[str, ...] = HEAD  #: the head's tensors (a bias-free head has no head.bias)

    def setup(self, global_params: Params, num_clients: int) -> None:
        head = [n for n in global_params if n.startswith("head.")]
        weight = global_params.get("head.weight")
        if not set(head) <= set(HEAD) or weight is None or weight.dim() != 2 or weight.shape[0] < 2:
            raise ConfigError(
                "FedRoD needs a network whose `head` is one linear classifier layer (head.weight with ≥ 2 classes, "
                f"head.bias): the generic head, to which the personal head is added; this network's head has "
                f"{', '.join(head) or 'no parameters'}"
            )
        self.head_names = tuple(n for n in HEAD if n in global_params)

    def init_client_state(self, global_params: Params) -> Params:
        return {PERSONAL + n: torch.zeros_like(global_params[n]) for n in self.head_names}

    def client_model(self, global_params: Params, state: Params) -> Params:
        """h_G(z) + h_P(z) as one linear head: (W_G + W_P, b_G + b_P)."""
        return {**global_params, **{n: global_params[n] + state[PERSONAL + n] for n in self.head_names}}

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        if num_classes is None:
            raise ConfigError("FedRoD is a classification method (balanced softmax over classes); the task has none")

    def objective(self, ctx: Client) -> Objective:
        """Per sample, ℓ_BSM of the generic head plus ℓ_P of the personal head on detached inputs (so the sum's
        gradient is ℓ_BSM's for θ, ψ and ℓ_P's for φ_i: both losses from one forward pass); ``train_loss`` reports
        ℓ_P (the personalised prediction's loss). ``data``: the client's log class prior ``shift``."""

        def loss(params: Params, x: Tensor, y: Tensor, data: Params) -> tuple[Tensor, Tensor]:
            z = features(ctx, params, x)
            generic = functional_call(ctx.net.head, _under(params, "head."), (z,))
            personal = functional_call(ctx.net.head, _under(params, PERSONAL + "head."), (z.detach(),))
            loss_generic = F.cross_entropy(generic + data["shift"], y, reduction="none")  # balanced softmax
            loss_personal = F.cross_entropy(generic.detach() + personal, y, reduction="none")
            return loss_generic + loss_personal, loss_personal

        return Objective(loss)

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        weight = global_params["head.weight"]
        counts = ctx.label_counts(weight.shape[-2]).to(weight.dtype)
        shift = prior_shift(counts)  # log π_c (−inf: absent class)
        personal = {PERSONAL + n: state[PERSONAL + n] for n in self.head_names}
        objective = self.objective(ctx)
        objective.data = {"shift": shift}
        trained = [*ctx.param_names, *personal]
        params = ctx.sgd({**global_params, **personal}, trained, self.local_epochs, objective=objective)
        shared = {n: params[n] for n in global_params}
        return ClientUpdate(
            upload={n: shared[n] for n in self.trained_names(shared)},
            state={n: params[n] for n in personal},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,  # the personalised prediction's loss
        )
