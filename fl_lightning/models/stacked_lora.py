"""The stacked multi-adapter step (issue 43): K clients' LoRA adapters and heads over ONE frozen base, in one pass.

The K clients' inputs ``[K, B, L]`` go through the base model together as one batch of K·B rows (each base weight
multiplies every input once, whatever K), and in every adapted layer each client's low-rank update is added with
batched matmuls over the stacked factors: for the rows of client k, ``h += s · (x A_kᵀ) B_kᵀ`` (``torch.bmm`` over
``A`` ``[K, r, d_in]`` and ``B`` ``[K, d_out, r]``; every adapter of the layer that ``params`` holds, so FedDPA's
global and local adapters add up as in peft). The head is stacked the same way (``[K, C, D]``). The loss is the sum
over clients of each client's mean loss, so the gradient of each client's tensors is that client's own, and an
elementwise optimiser (SGD, momentum, Adam) on the stacked tensors steps every client as its own loop would.

The engine's stacked executor steps ``LoRAClassifier`` runs with it: ``LoRAClassifier.stacked_forward`` calls
``stacked_forward`` here with the whole stacked parameter dict of a round (``engine.stacked.VectorizedContext``
through ``engine.stacked_nets.stacked_forward``). Its frozen base tensors arrive as the engine passes the global
model, ``[K, ...]`` views of one tensor with stride 0; the step multiplies by ``v[0]``, the one copy, and refuses a
base that differs per client. Tested equal to the per-client loop (``tests/models/test_stacked_lora.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

__all__ = ["shared_base", "stacked_forward", "stacked_loss", "stacked_names"]


def stacked_names(net: nn.Module, adapter: str = "default") -> list[str]:
    """The tensors a client owns in the stacked step: ``adapter``'s A and B of every layer, and the head."""
    names = [n for n, p in net.named_parameters() if p.requires_grad and f".{adapter}." in n]
    return names + [n for n, p in net.head.named_parameters(prefix="head") if p.requires_grad]


def _is_factor(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _one_tensor(v: Tensor) -> bool:
    """Whether ``[K, ...]`` ``v`` is one untrained tensor seen by every client (stride 0, or K = 1)."""
    return not v.requires_grad and (v.shape[0] == 1 or v.stride(0) == 0)


def shared_base(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The body's tensors of ``params`` other than the LoRA factors (names without ``body.``), one copy each: a
    ``[K, ...]`` tensor that is one tensor seen K times (stride 0, as the engine expands the global model) gives
    ``v[0]``; one that differs per client is refused (the step multiplies every client's rows by one base)."""
    out = {}
    for n, v in params.items():
        if not n.startswith("body.") or _is_factor(n):
            continue
        if not _one_tensor(v):
            raise ValueError(f"stacked LoRA step: {n} differs per client; the base must be one tensor shared by all")
        out[n[len("body.") :]] = v[0]
    return out


@contextlib.contextmanager
def _batched_lora(net: nn.Module, params: Mapping[str, Tensor], clients: int) -> Iterator[None]:
    """Inside: peft's own adapters off (the base alone), and in each LoRA layer the K clients' updates added for
    every adapter whose factors ``params`` holds."""
    from peft.tuners.lora import LoraLayer

    if getattr(net.body, "_weights", None):
        raise ValueError("stacked LoRA step: per-instance adapter weights (adapter_weights) run one client at a time")
    hooks = []
    for name, module in net.body.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        pairs = []
        for adapter in module.lora_A:
            a = params.get(f"body.{name}.lora_A.{adapter}.weight")
            b = params.get(f"body.{name}.lora_B.{adapter}.weight")
            if a is not None and b is not None:  # a [K, r, d_in], b [K, d_out, r]
                pairs.append((a, b, float(module.scaling[adapter])))

        def add_update(mod: nn.Module, args: tuple, out: Tensor, pairs: list = pairs) -> Tensor:
            x = args[0].reshape(clients, -1, args[0].shape[-1])  # [K, B·L, d_in]
            for a, b, s in pairs:
                delta = torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))  # [K, B·L, d_out]
                out = out + s * delta.reshape(out.shape)
            return out

        if pairs:
            hooks.append(module.register_forward_hook(add_update))
    try:
        with net.body.lm.disable_adapter():
            yield
    finally:
        for h in hooks:
            h.remove()


def stacked_forward(net: nn.Module, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """Logits ``[K, B, C]`` of K clients on their inputs ``x`` ``[K, B, L]``, each with its own stacked adapters and
    head in ``params`` (each ``[K, ...]``: at least ``stacked_names``), over one frozen base: the base tensors in
    ``params`` (``shared_base``), else the network's own."""
    k, b = x.shape[:2]
    base = shared_base(params)
    with _batched_lora(net, params, k):
        rows = x.reshape(k * b, *x.shape[2:])
        features = functional_call(net.body, base, (rows,)) if base else net.body(rows)
    features = features.reshape(k, b, -1)  # [K, B, D]
    if "head.weight" not in params:  # the network's own head (frozen, not passed)
        return net.head(features)
    weight, bias = params["head.weight"], params.get("head.bias")
    if _one_tensor(weight) and (bias is None or _one_tensor(bias)):  # a frozen head (a causal LM's vocabulary)
        return F.linear(features, weight[0], None if bias is None else bias[0])
    if bias is None:
        return torch.bmm(features, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), features, weight.transpose(1, 2))


def stacked_loss(net: nn.Module, params: Mapping[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
    """Σ_k (mean cross-entropy of client k on its batch): each client's tensors get their own client's gradient."""
    logits = stacked_forward(net, params, x)
    per_row = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return per_row.reshape(y.shape).mean(1).sum()
