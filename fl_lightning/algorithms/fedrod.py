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
epochs. The client uploads θ and ψ (FedAvg aggregation). Choices the paper leaves open, made here: φ_i starts at
zero (a client's first personal prediction is the generic one), and both steps happen at the same minibatch
(simultaneously, from the pre-step parameters). The paper's hypernetwork variant of the personal head is not
implemented.

Since h_G and h_P are linear, h_G(z) + h_P(z) is the linear head with weight W_G + W_P and bias b_G + b_P: that is
the model a client is evaluated with (``client_model``), so FedRoD needs a one-layer linear classifier ``head``.

Privacy: the uploaded θ, ψ never read φ_i (bit for bit); they are trained with the client's class prior π_i, which
they reveal to the extent that a BSM update does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import ClientContext, Params, step_limit
from fl_lightning.errors import ConfigError

PERSONAL = "p_head."
HEAD = ("head.weight", "head.bias")


def log_prior(y: Tensor, num_classes: int, dtype: torch.dtype) -> Tensor:
    """log π_c = log(N_c / N) of the client's labels (−inf for a class it does not have)."""
    counts = torch.bincount(y, minlength=num_classes).to(dtype)
    return counts.log() - math.log(max(y.shape[0], 1))


def features(ctx: ClientContext, params: Params, x: Tensor) -> Tensor:
    """z: the body's output (through the side-information branch when the network has one)."""
    net = ctx.net
    z = functional_call(net.body, _under(params, "body."), (x,))
    if getattr(net, "side", None) is not None:
        z = functional_call(net.side, _under(params, "side."), (z, ctx.side_for(x.shape[0])))
    return z


def _under(params: Params, prefix: str) -> Params:
    return {n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}


class FedRoD(Algorithm):
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

    def client_update(self, ctx: ClientContext, global_params: Params, state: Params) -> ClientUpdate:
        if ctx.y.is_floating_point():
            raise ConfigError("FedRoD is a classification method (balanced softmax over classes); the task has none")
        names = ctx.param_names
        shared = {n: t.detach().clone() for n, t in global_params.items()}  # buffers too: BN updates these copies
        personal = {n: state[PERSONAL + n].detach().clone() for n in self.head_names}
        leaves = {n: shared[n].requires_grad_(True) for n in names}
        for t in personal.values():
            t.requires_grad_(True)
        opt_shared, opt_personal = ctx.optimizer.build(leaves), ctx.optimizer.build(personal)
        shift = log_prior(ctx.y, shared["head.weight"].shape[0], shared["head.weight"].dtype)
        bs = ctx.optimizer.batch_size
        per_epoch = math.ceil(ctx.num_samples / bs)
        cap = step_limit(ctx.step_budget, self.local_epochs, ctx.num_samples, bs, None)
        total = self.local_epochs * per_epoch if cap is None else min(cap, self.local_epochs * per_epoch)
        steps, loss_sum = 0, 0.0
        for _ in range(self.local_epochs):
            for x, y in ctx.batches():
                if steps >= total:
                    break
                z = features(ctx, shared, x)
                generic = functional_call(ctx.net.head, _under(shared, "head."), (z,))
                loss_generic = F.cross_entropy(generic + shift, y)  # balanced softmax
                grads = torch.autograd.grad(loss_generic, list(leaves.values()), allow_unused=True)
                head_p = functional_call(ctx.net.head, _under(personal, "head."), (z.detach(),))
                loss_personal = F.cross_entropy(generic.detach() + head_p, y)
                grads_p = torch.autograd.grad(loss_personal, list(personal.values()))
                for leaf, g in (*zip(leaves.values(), grads), *zip(personal.values(), grads_p)):
                    leaf.grad = g  # None for a leaf the loss does not reach: the optimiser skips it
                opt_shared.step()
                opt_personal.step()
                loss_sum += float(loss_personal.detach())
                steps += 1
        ctx.train_loss = loss_sum / max(steps, 1)  # the personalised prediction's loss
        return ClientUpdate(
            upload={n: shared[n].detach() for n in self.trained_names(shared)},
            state={PERSONAL + n: t.detach() for n, t in personal.items()},
            num_samples=ctx.num_samples,
            loss=ctx.train_loss,
        )
