"""K clients' copies of a small MLP as batched matmuls: a local SGD step without ``vmap``.

``stacked_forward(module)`` turns a network built only of ``Sequential``, ``Linear``, ``Flatten`` and elementwise
activations (``DigitsMLP``, the heads of every ``SplitModel``, plain MLP bodies) into a ``StackedMLP``: a chain of
layers run on parameters stacked ``[K, ...]`` and inputs ``[K, B, ...]``, each ``Linear`` one ``torch.baddbmm``
``x Wᵀ + b`` over the K clients. ``stacked_value_and_grad`` gives every client's gradient of its own masked mean
minibatch loss, the math of ``vmap(grad_and_value(loss))`` (what ``VectorizedContext.sgd`` does otherwise):

* with cross-entropy or ½‖out − y‖² (``executors.per_sample_loss_for``) and ReLU/Tanh/Sigmoid/Identity
  activations, by hand: ∂ℓ/∂logits = (softmax − onehot)·m/Σm (or (out − y)·m/Σm), then for each ``Linear``
  ∂W = δᵀa, ∂b = Σδ, δ ← δW back through the chain (only as far as a trained parameter needs it);
* otherwise with one ``autograd.grad`` of the sum of the K losses (the clients share no parameter, so the
  gradient of the sum with respect to client k's slice is client k's own).

Other networks (convolutions, side branches, dropout, custom ``forward``, buffers) return ``None`` and keep
``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.local import Params

#: activations applied elementwise, so a leading client dimension changes nothing
ELEMENTWISE = (
    nn.ReLU, nn.LeakyReLU, nn.ELU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Softplus, nn.Identity, nn.Hardtanh,
)  # fmt: skip
#: activations whose derivative is written out here, from their output
BY_HAND = (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


@dataclass
class Layer:
    """One step of the chain: ``linear`` (parameter names), ``flatten`` (dims of one sample) or ``act``."""

    kind: str
    weight: str = ""
    bias: str | None = None
    module: nn.Module | None = None
    start: int = 1
    end: int = -1


class StackedMLP:
    """A chain of ``Layer`` s on stacked parameters ``[K, ...]`` and inputs ``[K, B, ...]``."""

    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers
        self.by_hand = all(layer.kind != "act" or type(layer.module) in BY_HAND for layer in layers)

    def __call__(self, params: Params, x: Tensor, trace: list[Tensor] | None = None) -> Tensor:
        for layer in self.layers:
            if trace is not None:
                trace.append(x)
            if layer.kind == "linear":
                flat = x.reshape(x.shape[0], -1, x.shape[-1])  # [K, B·…, in]
                w = params[layer.weight].transpose(1, 2)
                out = torch.baddbmm(params[layer.bias].unsqueeze(1), flat, w) if layer.bias else torch.bmm(flat, w)
                x = out.view(*x.shape[:-1], out.shape[-1])
            elif layer.kind == "flatten":
                x = x.flatten(layer.start + 1, layer.end if layer.end < 0 else layer.end + 1)
            else:
                x = layer.module(x)
        return x

    def backward(self, params: Params, trace: list[Tensor], out: Tensor, delta: Tensor, wanted: set[str]) -> Params:
        """Gradients of ``wanted`` parameters given ∂loss/∂out = ``delta`` (``trace``: every layer's input)."""
        grads: Params = {}
        first = min((i for i, ly in enumerate(self.layers) if ly.weight in wanted or ly.bias in wanted), default=None)
        if first is None:
            return grads
        outputs = [*trace[1:], out]
        for i in range(len(self.layers) - 1, first - 1, -1):
            layer, x = self.layers[i], trace[i]
            if layer.kind == "linear":
                flat_x = x.reshape(x.shape[0], -1, x.shape[-1])
                flat_d = delta.reshape(delta.shape[0], -1, delta.shape[-1])
                if layer.weight in wanted:
                    grads[layer.weight] = torch.bmm(flat_d.transpose(1, 2), flat_x)
                if layer.bias in wanted:
                    grads[layer.bias] = flat_d.sum(1)
                if i > first:
                    delta = torch.bmm(flat_d, params[layer.weight]).view(x.shape)
            elif layer.kind == "flatten":
                delta = delta.reshape(x.shape)
            else:
                y = outputs[i]
                kind = type(layer.module)
                if kind is nn.ReLU:
                    delta = torch.ops.aten.threshold_backward(delta, y, 0)  # δ where y > 0, else 0
                elif kind is nn.Tanh:
                    delta = delta * (1 - y * y)
                elif kind is nn.Sigmoid:
                    delta = delta * (y * (1 - y))
        return grads


def _chain(module: nn.Module, prefix: str) -> list[Layer] | None:
    if isinstance(module, nn.Linear):
        return [Layer("linear", prefix + "weight", prefix + "bias" if module.bias is not None else None)]
    if isinstance(module, nn.Flatten):
        return [Layer("flatten", start=module.start_dim, end=module.end_dim)] if module.start_dim >= 0 else None
    if type(module) in ELEMENTWISE:
        return [Layer("act", module=module)]
    if type(module) is nn.Sequential:
        layers: list[Layer] = []
        for name, child in module.named_children():
            part = _chain(child, f"{prefix}{name}.")
            if part is None:
                return None
            layers += part
        return layers
    from fl_lightning.models.split import SplitModel

    if isinstance(module, SplitModel) and type(module).forward is SplitModel.forward and module.side is None:
        body, head = _chain(module.body, prefix + "body."), _chain(module.head, prefix + "head.")
        return None if body is None or head is None else body + head
    return None


def stacked_forward(module: nn.Module) -> StackedMLP | None:
    """The module as a ``StackedMLP``, or None when it has anything else (including buffers)."""
    if any(True for _ in module.buffers()):
        return None
    layers = _chain(module, "")
    return None if layers is None else StackedMLP(layers)


def loss_kind(per_sample_loss: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    """``cross_entropy`` or ``half_squared_error`` if ``per_sample_loss`` computes exactly that (checked on a
    fixed example), else None."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(4, 3, generator=g), torch.tensor([0, 2, 1, 2])
    out, target = torch.randn(4, generator=g), torch.randn(4, generator=g)
    with torch.no_grad():
        try:
            if torch.equal(per_sample_loss(logits, labels), F.cross_entropy(logits, labels, reduction="none")):
                return "cross_entropy"
        except (RuntimeError, ValueError, TypeError, IndexError):
            pass
        try:
            if torch.equal(per_sample_loss(out, target), 0.5 * (out - target) ** 2):
                return "half_squared_error"
        except (RuntimeError, ValueError, TypeError, IndexError):
            pass
    return None


def stacked_value_and_grad(
    forward: StackedMLP,
    per_sample_loss: Callable[[Tensor, Tensor], Tensor],
    names: dict[str, str],
    train: Params,
    fixed: Params,
    x: Tensor,
    y: Tensor,
    mask: Tensor,
    kind: str | None = None,
) -> tuple[Params, Tensor] | None:
    """Every client's gradient of its masked mean minibatch loss with respect to ``train`` (``[K, ...]`` each) and
    the losses ``[K]``; ``fixed`` are the other parameters, ``names`` maps the names the module sees, ``kind`` is
    ``loss_kind(per_sample_loss)``. None if the per-sample loss is not one number per sample (then the caller
    keeps ``vmap``)."""
    weight = mask / mask.sum(1, keepdim=True)  # [K, B]: each client's minibatch mean
    if kind is not None and forward.by_hand:
        local = {names[n]: v for n, v in {**fixed, **train}.items() if n in names}
        trace: list[Tensor] = []
        out = forward(local, x, trace)
        if kind == "cross_entropy":
            if out.dim() != 3:
                return None
            logp = out.log_softmax(-1)
            target = y.unsqueeze(-1)
            per = -logp.gather(-1, target).squeeze(-1)
            delta = logp.exp().scatter_add(-1, target, torch.full_like(per, -1.0).unsqueeze(-1))
            delta = delta * weight.unsqueeze(-1)
        else:
            if out.shape != mask.shape or y.shape != mask.shape:
                return None
            diff = out - y
            per, delta = 0.5 * diff * diff, diff * weight
        losses = (per * mask).sum(1) / mask.sum(1)
        local_grads = forward.backward(local, trace, out, delta, {names[n] for n in train})
        grads = {n: local_grads.get(names[n]) for n in train}
        return {n: torch.zeros_like(train[n]) if g is None else g for n, g in grads.items()}, losses
    leaves = {n: v.detach().requires_grad_(True) for n, v in train.items()}
    local = {names[n]: v for n, v in {**fixed, **leaves}.items() if n in names}
    with torch.enable_grad():
        out = forward(local, x)
        per = per_sample_loss(out.flatten(0, 1), y.flatten(0, 1))
        if per.shape != (mask.numel(),):
            return None
        losses = (per.view(mask.shape) * mask).sum(1) / mask.sum(1)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
    return {n: torch.zeros_like(v) if g is None else g for (n, v), g in zip(leaves.items(), grads)}, losses.detach()
