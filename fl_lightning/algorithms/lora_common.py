"""Names of LoRA adapter tensors (peft's ``…lora_A.<adapter>.weight`` / ``…lora_B.<adapter>.weight``), for the
adapter methods (FedIT, FFA-LoRA, FedSA-LoRA, FLoRA, FedDPA). Only names: an algorithm never imports a model."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fl_lightning.client import name_matches
from fl_lightning.errors import ConfigError

LORA_A, LORA_B = "*.lora_A", "*.lora_B"


def is_lora_a(name: str) -> bool:
    return name_matches(name, LORA_A)


def is_lora_b(name: str) -> bool:
    return name_matches(name, LORA_B)


def require_lora(method: str, names: Iterable[str]) -> None:
    """One line when the network has no trainable LoRA adapter (the method needs ``LoRAClassifier`` or another
    peft-adapted network)."""
    if not any(is_lora_a(n) for n in names):
        raise ConfigError(
            f"{method} trains LoRA adapters, but the network has no trainable *.lora_A parameter; "
            "use model.network: fl_lightning.models.LoRAClassifier"
        )


def lora_layers(net: nn.Module) -> dict[str, tuple[str, str, str, float]]:
    """Per LoRA layer and adapter of ``net``: ``{A name: (A name, B name, base weight name, scaling)}``, read from
    the modules' ``lora_A``/``lora_B``/``scaling`` attributes (peft's LoRA layers), without importing peft."""
    out = {}
    for prefix, module in net.named_modules():
        lora_a, scaling = getattr(module, "lora_A", None), getattr(module, "scaling", None)
        if isinstance(lora_a, nn.ModuleDict) and isinstance(scaling, dict):
            for adapter in lora_a:
                a = f"{prefix}.lora_A.{adapter}.weight"
                b, base = f"{prefix}.lora_B.{adapter}.weight", f"{prefix}.base_layer.weight"
                out[a] = (a, b, base, float(scaling[adapter]))
    return out
