"""A causal language model with peft LoRA adapters as the split model of an instruction-tuning run (issue 43).

``LoRACausalLM`` is ``LoRAClassifier``'s causal-LM form: ``body`` is the decoder under the LM head (e.g. LLaMA's
``model``, GPT-2's ``transformer``) with peft's LoRA adapters, read at the last non-padding position of each row
(inputs are right-padded, so positions and the causal mask are those of the unpadded text); ``head`` is the model's
own output projection onto the vocabulary (a copy of its pretrained weights), frozen unless ``train_head``. So
``head(body(x))`` is the logits of the token that follows ``x``: the LM's next-token prediction.

Each sample is one target token of an instruction example (``datamodules.instruction``: the prompt and the response
before it as ``x``, the token as ``y``), so the engine's mean cross-entropy over samples is the token-level loss of
causal-LM fine-tuning with the prompt masked out (labels -100), its accuracy the next-token accuracy, and
exp(loss) the perplexity. FedIT, FFA-LoRA, FedSA-LoRA and the other adapter methods run on it unchanged, on the
stacked path too (``models.stacked_lora``: the cohort's rows through the one frozen base).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fl_lightning.models.adapters import LoRAClassifier, PooledLoRAEncoder
from fl_lightning.models.split import SplitModel

__all__ = ["LoRACausalLM"]


class LoRACausalLM(LoRAClassifier):
    """``head(φ(x))``: a causal LM's next-token logits over its vocabulary, LoRA adapters on its decoder.

    Args:
        model, config: the checkpoint (a folder or ``package:NAME``) or a random-init config (``model_type: llama``,
            ``gpt2``, …), as ``LoRAClassifier``.
        adapters, rank, alpha, lora_dropout, target_modules: peft's ``LoraConfig`` (LLaMA: ``[q_proj, v_proj]``,
            as FedDPA's and FedIT's scripts; GPT-2: ``[c_attn]``).
        pad_token_id: the padding id of the inputs (default: the model config's, else 0).
        base_dropout, layers: as ``LoRAClassifier``.
        train_head: train the output projection too (it is then uploaded and personal where an algorithm says so);
            default frozen, as in LoRA instruction tuning, where only the adapters train.
    """

    def __init__(
        self,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        adapters: Sequence[str] = ("default",),
        rank: int = 8,
        alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: list[str] | None = None,
        pad_token_id: int | None = None,
        base_dropout: float = 0.0,
        layers: int | None = None,
        train_head: bool = False,
    ) -> None:
        body = PooledLoRAEncoder(model, config, adapters, rank, alpha, lora_dropout, target_modules, "last",
                                 pad_token_id, base_dropout, layers, causal_lm=True)  # fmt: skip
        (weight,) = body.lm_head
        body.lm_head = ()
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        head.weight.requires_grad_(train_head)
        SplitModel.__init__(self, body, head)
        self._engine_attributes(lora_dropout)

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])
