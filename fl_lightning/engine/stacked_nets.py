"""Networks over stacked clients: forward passes and gradients of ``K`` clients' parameters ``[K, ...]`` at once.

``sequential_forward`` (an ``nn.Sequential`` with each ReLU before a max-pool moved after it), the per-sample losses,
``stack``/``unstack`` of parameter dicts, ``stacked_forward`` (Linear/elementwise networks as batched matrix
products, no ``vmap``) and ``relu_net_gradient`` (a ReLU network's backpropagation written out, no autograd graph):
the arithmetic the stacked path (``engine/stacked.py``) steps with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.client import (
    Params,
)
from fl_lightning.models.split import SplitModel


def sequential_forward(module: nn.Module, params: Params, x: Tensor) -> Tensor:
    """``functional_call(module, params, (x,))`` with less memory traffic when ``module`` is an ``nn.Sequential`` (or
    a ``SplitModel`` without a side branch whose body is one): a ``ReLU`` before a ``MaxPool2d`` runs after it, on the
    4× smaller pooled tensor (max and ReLU commute: the same values and gradients), and every such ``ReLU`` in place
    on a tensor this pass made, which no backward needs (the outputs of convolutions, linear layers and pools)."""
    if isinstance(module, SplitModel) and type(module).forward is SplitModel.forward and module.side is None:
        head = {n[len("head.") :]: v for n, v in params.items() if n.startswith("head.")}
        body = {n[len("body.") :]: v for n, v in params.items() if n.startswith("body.")}
        return functional_call(module.head, head, (sequential_forward(module.body, body, x),))
    if type(module) is not nn.Sequential:
        return functional_call(module, params, (x,))
    children = list(module.named_children())
    fresh, i = False, 0  # fresh: x was made by a convolution, linear layer or pool of this pass (not the caller's)
    while i < len(children):
        name, child = children[i]
        after = children[i + 1][1] if i + 1 < len(children) else None
        if type(child) is nn.ReLU and type(after) is nn.MaxPool2d and not after.return_indices:
            x, fresh, i = _max_pool(after, x).relu_(), False, i + 2
            continue
        if type(child) is nn.ReLU and fresh:
            x = x.relu_()
        else:
            own = {n[len(name) + 1 :]: v for n, v in params.items() if n.startswith(name + ".")}
            x = functional_call(child, own, (x,)) if own else child(x)
        fresh, i = isinstance(child, (nn.modules.conv._ConvNd, nn.Linear, nn.MaxPool2d)), i + 1
    return x


def _max_pool(pool: nn.MaxPool2d, x: Tensor) -> Tensor:
    """``pool(x)``; a plain 2×2 pool without autograd as two elementwise maxima of strided views (the same values,
    without the argmax indices a ``max_pool2d`` computes on the CPU)."""
    setting = (pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)
    if torch.is_grad_enabled() or x.dim() != 4 or setting not in ((2, 2, 0, 1, False), ((2, 2), (2, 2), 0, 1, False)):
        return pool(x)
    h, w = x.shape[2] // 2 * 2, x.shape[3] // 2 * 2
    rows = torch.maximum(x[:, :, 0:h:2, :w], x[:, :, 1:h:2, :w])
    return torch.maximum(rows[..., 0::2], rows[..., 1::2])


def channels_last(t: Tensor) -> Tensor:
    """A 4-D tensor (an image batch, a conv weight) in ``channels_last``; others as they are."""
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def per_sample_cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def per_sample_half_squared_error(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((out - y) ** 2).reshape(out.shape[0], -1).mean(1)


def per_sample_loss_for(num_classes: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy, or ½·squared error averaged over each sample's outputs (so that its batch mean is the
    sequential loop's ``0.5 * mse_loss``)."""
    return per_sample_half_squared_error if num_classes is None else per_sample_cross_entropy


def has_conv(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in net.modules())


def has_rnn(net: nn.Module) -> bool:
    return any(isinstance(m, nn.RNNBase) for m in net.modules())


def pad_rows(rows: Sequence[Tensor]) -> Tensor:
    """``[K, n_max, ...]``: each client's rows, zero-padded to the longest."""
    out = rows[0].new_zeros((len(rows), max(r.shape[0] for r in rows), *rows[0].shape[1:]))
    for k, r in enumerate(rows):
        out[k, : r.shape[0]] = r
    return out


def stack(dicts: Sequence[Params]) -> Params:
    return {n: torch.stack([d[n] for d in dicts]) for n in dicts[0]} if dicts else {}


def unstack(stacked: Params, k: int) -> Params:
    return {n: v[k] for n, v in stacked.items()}


# ---- batched forward passes without vmap ---------------------------------------------------------------------
ELEMENTWISE = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.ELU, nn.LeakyReLU, nn.SiLU, nn.Softplus, nn.Identity)


def own_stacked_forward(module: nn.Module) -> Callable[[Params, Tensor], Tensor] | None:
    """A network's own stacked forward ``(params [K, ...], x [K, B, ...]) → [K, B, ...]``, if it has one
    (``LoRAClassifier``: the cohort's adapters over one frozen base, ``models.stacked_lora``)."""
    own = getattr(module, "stacked_forward", None)
    return own if callable(own) else None


def stackable(module: nn.Module) -> bool:
    """Whether ``stacked_forward`` computes ``module`` for stacked parameters: ``Linear``, elementwise activations,
    ``Flatten``, ``Sequential`` of those, a ``SplitModel`` of those without a side branch, and a network with its
    own stacked forward (``own_stacked_forward``)."""
    if own_stacked_forward(module) is not None:
        return True
    kind = type(module)
    if kind is nn.Linear or kind is nn.Flatten or kind in ELEMENTWISE:
        return True
    if kind is nn.Sequential:
        return all(stackable(m) for m in module)
    if isinstance(module, SplitModel) and kind.forward is SplitModel.forward and module.side is None:
        return stackable(module.body) and stackable(module.head)
    return False


def stacked_forward(module: nn.Module, params: Params, x: Tensor, prefix: str = "") -> Tensor:
    """``module`` applied by every client ``k`` with its parameters ``params[name][k]`` to its inputs ``x[k]``
    (``[K, B, ...]`` → ``[K, B, ...]``): a ``Linear`` is one batched matrix product (``baddbmm``)."""
    own = own_stacked_forward(module)
    if own is not None:
        return own({n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}, x)
    kind = type(module)
    if kind is nn.Linear:
        weight, bias = params[prefix + "weight"], params.get(prefix + "bias")
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        if bias is None:
            out = torch.bmm(flat, weight.transpose(1, 2))
        else:
            out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
        return out.reshape(*x.shape[:-1], weight.shape[1])
    if kind is nn.Flatten:
        start = module.start_dim + 1 if module.start_dim >= 0 else module.start_dim
        end = module.end_dim + 1 if module.end_dim >= 0 else module.end_dim
        return x.flatten(start, end)
    if kind in ELEMENTWISE:
        return module(x)
    if kind is nn.Sequential:
        for name, child in module.named_children():
            x = stacked_forward(child, params, x, f"{prefix}{name}.")
        return x
    if isinstance(module, SplitModel):
        features = stacked_forward(module.body, params, x, prefix + "body.")
        return stacked_forward(module.head, params, features, prefix + "head.")
    raise TypeError(f"stacked_forward: {kind.__name__} is not supported")


# ---- a ReLU network's gradient by hand ---------------------------------------------------------------------------
#: one layer of a network ``relu_layers`` can differentiate by hand: ("linear", parameter prefix), ("relu", None)
#: or ("flatten", the nn.Flatten)
Layer = tuple[str, Any]


def relu_layers(module: nn.Module, prefix: str = "") -> list[Layer] | None:
    """``module`` as its layers in order when it is made of ``Linear``, ``ReLU`` and ``Flatten`` only (a
    ``Sequential`` of those, or a ``SplitModel`` of those without a side branch), else None."""
    kind = type(module)
    if kind is nn.Linear:
        return [("linear", prefix)]
    if kind is nn.ReLU:
        return [("relu", None)]
    if kind is nn.Flatten:
        return [("flatten", module)]
    if kind is nn.Sequential:
        layers: list[Layer] = []
        for name, child in module.named_children():
            inner = relu_layers(child, f"{prefix}{name}.")
            if inner is None:
                return None
            layers += inner
        return layers
    if isinstance(module, SplitModel) and kind.forward is SplitModel.forward and module.side is None:
        body, head = relu_layers(module.body, prefix + "body."), relu_layers(module.head, prefix + "head.")
        return None if body is None or head is None else body + head
    return None


def relu_net_gradient(
    layers: list[Layer], params: Params, x: Tensor, y: Tensor, mask: Tensor, trainable: set[str]
) -> tuple[Params, Tensor]:
    """Every client's masked mean cross-entropy ``L_k = Σ_b m_kb·ce_kb / max(Σ_b m_kb, 1)`` of the network
    ``layers`` (``relu_layers``) with its parameters ``params[name][k]`` on ``x[k]``, and its gradient for the
    ``trainable`` names, by backpropagation written out (no autograd graph): ∂L/∂z = (softmax(z) − onehot(y))·m/n
    at the logits; a linear layer h → hWᵀ + b gives ∂W = δᵀh, ∂b = Σδ and passes δW down; a ReLU passes δ where its
    output is positive. Returns ({name: [K, ...]}, losses [K])."""
    h, kept = x, []
    for kind, arg in layers:
        if kind == "linear":
            weight, bias = params[arg + "weight"], params.get(arg + "bias")
            flat = h.reshape(h.shape[0], -1, h.shape[-1])
            kept.append((h.shape, flat))
            out = torch.bmm(flat, weight.transpose(1, 2)) if bias is None else torch.baddbmm(
                bias.unsqueeze(1), flat, weight.transpose(1, 2))  # fmt: skip
            h = out.reshape(*h.shape[:-1], weight.shape[1])
        elif kind == "relu":
            h = h.relu()
            kept.append(h)
        else:
            kept.append(h.shape)
            start = arg.start_dim + 1 if arg.start_dim >= 0 else arg.start_dim
            end = arg.end_dim + 1 if arg.end_dim >= 0 else arg.end_dim
            h = h.flatten(start, end)
    k, b = mask.shape
    log_p = torch.log_softmax(h.reshape(k, b, -1), -1)
    per_sample = -log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    n = mask.sum(1).clamp(min=1)
    losses = (per_sample * mask).sum(1) / n
    delta = log_p.exp()
    delta.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(delta[..., :1], -1.0))
    delta = delta * (mask / n.unsqueeze(1)).unsqueeze(-1)
    trained = [i for i, (kind, arg) in enumerate(layers) if kind == "linear" and (
        arg + "weight" in trainable or arg + "bias" in trainable)]  # fmt: skip
    grads: Params = {}
    for i in range(len(layers) - 1, min(trained, default=len(layers)) - 1, -1):
        kind, arg = layers[i]
        if kind == "linear":
            shape, flat = kept[i]
            rows = delta.reshape(k, -1, delta.shape[-1])
            if arg + "weight" in trainable:
                grads[arg + "weight"] = torch.bmm(rows.transpose(1, 2), flat)
            if arg + "bias" in trainable:
                grads[arg + "bias"] = rows.sum(1)
            if i > trained[0]:
                delta = torch.bmm(rows, params[arg + "weight"]).reshape(shape)
        elif kind == "relu":
            delta = delta * (kept[i] > 0)
        else:
            delta = delta.reshape(kept[i])
    return grads, losses
