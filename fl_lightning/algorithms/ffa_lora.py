"""FFA-LoRA (Sun et al., "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024): LoRA's A matrices
stay frozen at their random initialisation; clients train only B (and the head) and the server averages B, so the
aggregate of the products is the product of the aggregates (Σ pᵢ B_i A = (Σ pᵢ B_i) A) and the update is linear in
what is noised under DP. Following FedSA-LoRA's authors' FFA-LoRA baseline (``federatedscope/glue/model/
model_builder.py``: ``freeze_A`` sets ``requires_grad = False`` on every ``lora_A``), A is neither trained,
uploaded nor sent: every client holds the same initial A, which never changes.
"""

from __future__ import annotations

from torch import nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.lora_common import is_lora_a, require_lora
from fl_lightning.client import Client, Params


class FFALoRA(Algorithm):
    vectorizable = True  # ctx.sgd and dict operations only
    reveals = "the local SGD update of LoRA B (and the head) on the client's data; A is fixed and never sent"

    def __init__(self, local_epochs: int = 1) -> None:
        super().__init__()
        self.local_epochs = local_epochs

    def check_compatible(self, net: nn.Module, num_classes: int | None) -> None:
        require_lora(type(self).__name__, (n for n, p in net.named_parameters() if p.requires_grad))

    def shared_names(self, params: Params) -> list[str]:
        """What is averaged: every trained tensor but the frozen-at-init A matrices."""
        return [n for n in super().shared_names(params) if not is_lora_a(n)]

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        trained = [n for n in ctx.param_names if not is_lora_a(n)]
        params = ctx.sgd(self.client_model(global_params, state), trained, self.local_epochs)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)
