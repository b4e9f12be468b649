"""The stacked multi-adapter step (issue 43): K clients' LoRA adapters and heads over ONE frozen base, in one pass.

The K clients' inputs ``[K, B, L]`` go through the base model together as one batch of K·B rows (each base weight
multiplies every input once, whatever K), and in every adapted layer each client's low-rank update is added with
batched matmuls over the stacked factors: for the rows of client k, ``h += s · (x A_kᵀ) B_kᵀ`` (``torch.bmm`` over
``A`` ``[K, r, d_in]`` and ``B`` ``[K, d_out, r]``). The head is stacked the same way (``[K, C, D]``). The loss is
the sum over clients of each client's mean loss, so the gradient of each client's tensors is that client's own, and
an elementwise optimiser (SGD, momentum, Adam) on the stacked tensors steps every client as its own loop would.

This is the math of the batched path, tested equal to the per-client loop (``tests/models/test_stacked_lora.py``);
the engine's stacked executor does not call it yet: ``LoRAClassifier`` runs its clients in the loop
(``LoRAClassifier.stacked_blocker``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.models.adapters import LoRAClassifier

__all__ = ["stacked_forward", "stacked_loss", "stacked_names"]


def stacked_names(net: LoRAClassifier, adapter: str = "default") -> list[str]:
    """The tensors a client owns in the stacked step: ``adapter``'s A and B of every layer, and the head."""
    names = [n for n, p in net.named_parameters() if p.requires_grad and f".{adapter}." in n]
    return names + [n for n, _ in net.head.named_parameters(prefix="head")]


@contextlib.contextmanager
def _batched_lora(net: LoRAClassifier, params: dict[str, Tensor], clients: int, adapter: str) -> Iterator[None]:
    """Inside: peft's own adapters off (the base alone), and in each LoRA layer the K clients' updates added."""
    from peft.tuners.lora import LoraLayer

    hooks = []
    prefix = "body."
    for name, module in net.body.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
            continue
        a = params[f"{prefix}{name}.lora_A.{adapter}.weight"]  # [K, r, d_in]
        b = params[f"{prefix}{name}.lora_B.{adapter}.weight"]  # [K, d_out, r]
        scale = module.scaling[adapter]

        def add_update(mod: nn.Module, args: tuple, out: Tensor, a: Tensor = a, b: Tensor = b, s: float = scale):
            x = args[0].reshape(clients, -1, args[0].shape[-1])  # [K, B·L, d_in]
            delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))  # [K, B·L, d_out]
            return out + s * delta.reshape(out.shape)

        hooks.append(module.register_forward_hook(add_update))
    try:
        with net.body.lm.disable_adapter():
            yield
    finally:
        for h in hooks:
            h.remove()


def stacked_forward(net: LoRAClassifier, params: dict[str, Tensor], x: Tensor, adapter: str = "default") -> Tensor:
    """Logits ``[K, B, C]`` of K clients on their inputs ``x`` ``[K, B, L]``, each with its own stacked adapter and
    head in ``params`` (``stacked_names``, each ``[K, ...]``), over the network's one frozen base."""
    k, b = x.shape[:2]
    with _batched_lora(net, params, k, adapter):
        features = net.body(x.reshape(k * b, *x.shape[2:])).reshape(k, b, -1)  # [K, B, D]
    return torch.baddbmm(params["head.bias"].unsqueeze(1), features, params["head.weight"].transpose(1, 2))


def stacked_loss(
    net: LoRAClassifier, params: dict[str, Tensor], x: Tensor, y: Tensor, adapter: str = "default"
) -> Tensor:
    """Σ_k (mean cross-entropy of client k on its batch): each client's tensors get their own client's gradient."""
    logits = stacked_forward(net, params, x, adapter)
    per_row = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return per_row.reshape(y.shape).mean(1).sum()
