"""``fl_lightning/algorithms/lora_common.py``: which names are LoRA's A and B factors (peft's naming), the one-line
refusal of a network without adapters, and the layers read off a peft-like module written here."""

from __future__ import annotations

import pytest
from torch import nn

from fl_lightning.algorithms.lora_common import is_lora_a, is_lora_b, lora_layers, require_lora
from fl_lightning.errors import ConfigError


def test_factor_names_follow_peft() -> None:
    a, b = "base.layers.0.q_proj.lora_A.default.weight", "base.layers.0.q_proj.lora_B.default.weight"
    assert is_lora_a(a) and not is_lora_b(a)
    assert is_lora_b(b) and not is_lora_a(b)
    assert not is_lora_a("base.layers.0.q_proj.base_layer.weight") and not is_lora_b("head.weight")


def test_a_network_without_a_trainable_a_factor_is_refused_in_one_line() -> None:
    require_lora("FedIT", ["x.lora_A.default.weight", "head.weight"])  # has one: nothing raised
    with pytest.raises(ConfigError, match=r"^FFA-LoRA trains LoRA adapters, but the network has no trainable"):
        require_lora("FFA-LoRA", ["body.weight", "x.lora_B.default.weight"])


class _LoRALinear(nn.Module):
    """The attributes peft's ``lora.Linear`` has: ``base_layer``, ``lora_A``/``lora_B`` per adapter, ``scaling``."""

    def __init__(self, adapters: dict[str, float]) -> None:
        super().__init__()
        self.base_layer = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({n: nn.Linear(4, 2, bias=False) for n in adapters})
        self.lora_B = nn.ModuleDict({n: nn.Linear(2, 4, bias=False) for n in adapters})
        self.scaling = dict(adapters)


def test_lora_layers_reads_every_layer_and_adapter_with_its_scaling() -> None:
    net = nn.Module()
    net.q = _LoRALinear({"default": 2.0})
    net.v = _LoRALinear({"default": 0.5, "other": 4.0})
    net.plain = nn.Linear(4, 4)
    assert lora_layers(net) == {
        "q.lora_A.default.weight": ("q.lora_A.default.weight", "q.lora_B.default.weight", "q.base_layer.weight", 2.0),
        "v.lora_A.default.weight": ("v.lora_A.default.weight", "v.lora_B.default.weight", "v.base_layer.weight", 0.5),
        "v.lora_A.other.weight": ("v.lora_A.other.weight", "v.lora_B.other.weight", "v.base_layer.weight", 4.0),
    }
    names = {n for n, _ in net.named_parameters()}
    assert all(a in names and b in names and base in names for a, b, base, _ in lora_layers(net).values())
