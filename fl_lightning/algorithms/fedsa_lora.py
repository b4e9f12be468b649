"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025): A
matrices learn general knowledge and are shared (averaged), B matrices learn client-specific knowledge and stay
on the client, and so does the classifier on classification tasks (authors' code, ``federatedscope/glue/yamls/
fedsa-lora.yaml``: ``personalization.local_param: ['lora_B', 'classifier']``). Each round a client trains A, B and
the head jointly for E local epochs from the global A and its own B and head, and uploads A only.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.lora_common import require_lora


class FedSALoRA(FedAvg):
    vectorizable = True  # ctx.sgd and dict operations only

    def __init__(self, local_epochs: int = 1, personal: Sequence[str] = ("*.lora_B", "head.")) -> None:
        super().__init__(local_epochs, personal)

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        require_lora(type(self).__name__, (n for n, p in net.named_parameters() if p.requires_grad))
