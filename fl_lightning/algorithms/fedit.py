"""FedIT (Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024): each
sampled client trains its LoRA adapters (A and B, and a task head where the network has one) for E local epochs
from the global adapters, and the server averages them weighted by the clients' sample counts, i.e. FedAvg over
A and B (authors' code, FederatedGPT-Shepherd ``fed_utils/model_aggregation.py``: weights = local dataset sizes,
L1-normalised). The base model is frozen and never leaves the server.
"""

from __future__ import annotations

from torch import nn

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.lora_common import require_lora


class FedIT(FedAvg):
    """FedAvg on every trainable tensor of an adapter network (LoRA A, B and the head); nothing personal."""

    vectorizable = True  # ctx.sgd and dict operations only

    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__(local_epochs, personal=None)

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        require_lora(type(self).__name__, (n for n, p in net.named_parameters() if p.requires_grad))
