"""A pretrained Hugging Face model with peft LoRA adapters as the split model of a run (issue 43).

``LoRAClassifier`` is a ``SplitModel``: ``body`` is the frozen transformer with peft's LoRA adapters on its target
modules, pooled to one vector per text (φ(x)); ``head`` is a linear classifier. Only the adapter matrices (names
``body.lm.…lora_A.<adapter>.weight`` / ``…lora_B.<adapter>.weight``) and the head train: the base weights have
``requires_grad=False``, so the engine neither banks, uploads, sends nor checkpoints them (``Algorithm.frozen``), and
they live once in the process whatever the cohort (every client's forward reads the same tensors).

Input ``x`` is a ``[B, L]`` tensor of token ids (``datamodules.adapter_text``); the attention mask is ``x != pad``.

The model comes from a local folder (``model: path/to/hf_checkpoint``), from an installed package that ships one
(``model: package:all_minilm_l6_v2``: the package folder's ``model.zip`` or checkpoint, no download), or is built
randomly initialised from a config (``config: {model_type: bert, hidden_size: 32, …}``, for tests). LoRA itself is
peft's (``LoraConfig``, ``get_peft_model``); this file only wires it into the split-model naming and adds
per-instance adapter weights (FedDPA's instance-wise combination, ``adapter_weights``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel

__all__ = ["LoRAClassifier", "PooledLoRAEncoder", "lora_pairs", "resolve_model_path"]

PACKAGE = "package:"
#: where ``package:NAME`` checkpoints shipped zipped are unpacked once (override with FL_LIGHTNING_MODEL_CACHE)
CACHE = Path(os.environ.get("FL_LIGHTNING_MODEL_CACHE", Path.home() / ".cache" / "fl_lightning" / "models"))
#: config fields set to ``base_dropout`` (dropout inside the frozen transformer; 0 keeps a client update a pure
#: function of its seed, and the loop and a batched step equal)
DROPOUT_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout", "attention_dropout",
                  "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")  # fmt: skip


def resolve_model_path(model: str) -> Path:
    """A local checkpoint folder for ``model``: a folder, or ``package:NAME``, an installed package that ships a
    checkpoint (its folder holds ``config.json``, or a ``model.zip`` that is unpacked once under ``CACHE``). Never
    downloads; a missing package or folder is refused in one line."""
    if model.startswith(PACKAGE):
        name = model[len(PACKAGE) :]
        spec = importlib.util.find_spec(name)  # locates the package without importing (running) it
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.network.model '{model}': package {name} is not installed; fix: pip install "
                f"'{name.replace('_', '-')}-model' (or pip install -e '.[pretrained]'), or give a local folder"
            )
        folder = Path(next(iter(spec.submodule_search_locations)))
        if (folder / "config.json").is_file():
            return folder
        archive = folder / "model.zip"
        if not archive.is_file():
            raise ConfigError(f"model.network.model '{model}': {folder} has neither config.json nor model.zip")
        target = CACHE / name
        if not (target / "config.json").is_file():
            target.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(target)
        return target
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.network.model '{model}': no Hugging Face checkpoint (config.json) in that folder")
    return path


def _build_backbone(
    model: str | None,
    config: Mapping[str, Any] | None,
    base_dropout: float,
    layers: int | None = None,
    causal_lm: bool = False,
) -> nn.Module:
    """The transformer (``AutoModel``), or with ``causal_lm`` the whole causal LM (``AutoModelForCausalLM``)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if causal_lm else AutoModel

    if (model is None) == (config is None):
        raise ConfigError("model.network: give exactly one of model (a checkpoint) and config (a random init)")
    if config is not None:
        cfg = dict(config)
        if "model_type" not in cfg:
            raise ConfigError("model.network.config needs model_type (e.g. bert)")
        hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    else:
        hf_config = AutoConfig.from_pretrained(resolve_model_path(model))
    for field in DROPOUT_FIELDS:
        if isinstance(getattr(hf_config, field, None), float):
            setattr(hf_config, field, base_dropout)
    if layers is not None:  # keep the first ``layers`` transformer layers (their pretrained weights)
        have = getattr(hf_config, "num_hidden_layers", None)
        if have is None or not 1 <= layers <= have:
            raise ConfigError(f"model.network.layers {layers}: the model has {have} layers")
        hf_config.num_hidden_layers = layers
    if config is not None:
        return auto.from_config(hf_config)
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the layers that ``layers`` leaves out
    try:
        return auto.from_pretrained(resolve_model_path(model), config=hf_config)
    finally:
        hf_logging.set_verbosity(level)


def lora_pairs(net: nn.Module, adapter: str | None = None) -> list[tuple[str, str, str]]:
    """``(A name, B name, base weight name)`` of every LoRA layer of ``net`` (for ``adapter``, default all),
    in module order: what FLoRA stacks and the batched adapter step multiplies."""
    from peft.tuners.lora import LoraLayer

    out = []
    for prefix, module in net.named_modules():
        if isinstance(module, LoraLayer):
            for name in module.lora_A:
                if adapter is None or name == adapter:
                    out.append((f"{prefix}.lora_A.{name}.weight", f"{prefix}.lora_B.{name}.weight",
                                f"{prefix}.base_layer.weight"))  # fmt: skip
    return out


class PooledLoRAEncoder(nn.Module):
    """φ(x): the transformer (with peft LoRA adapters) over token ids, pooled to ``[B, hidden]``.

    ``pooling``: ``mean`` over the non-padding tokens (sentence encoders such as MiniLM), ``cls`` (the first token,
    BERT-style) or ``last`` (the last non-padding token, decoders)."""

    def __init__(
        self,
        model: str | None = None,
        config: Mapping[str, Any] | None = None,
        adapters: Sequence[str] = ("default",),
        rank: int = 8,
        alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: Sequence[str] | None = None,
        pooling: Literal["mean", "cls", "last"] = "mean",
        pad_token_id: int | None = None,
        base_dropout: float = 0.0,
        layers: int | None = None,
        causal_lm: bool = False,
    ) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model

        if rank < 1:
            raise ConfigError(f"model.network.rank must be ≥ 1, got {rank}")
        if not adapters:
            raise ConfigError("model.network.adapters must name at least one adapter")
        backbone = _build_backbone(model, config, base_dropout, layers, causal_lm)
        #: a causal LM's output projection (vocabulary logits), kept out of this module (``LoRACausalLM``'s head)
        self.lm_head: tuple[Tensor, ...] = ()
        if causal_lm:  # the transformer under the LM head; the head's weights go to the split model's head
            self.lm_head = (backbone.get_output_embeddings().weight.detach().clone(),)
            backbone = backbone.base_model
        pad = pad_token_id if pad_token_id is not None else getattr(backbone.config, "pad_token_id", None)
        self.pad_token_id = 0 if pad is None else int(pad)
        self.pooling = pooling
        lora = LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=lora_dropout, bias="none",
            target_modules=list(target_modules) if target_modules is not None else None,
        )  # fmt: skip
        try:
            self.lm = get_peft_model(backbone, lora, adapter_name=adapters[0])
        except ValueError as err:  # peft: target modules not found in the model
            raise ConfigError(f"model.network.target_modules {target_modules}: {str(err).splitlines()[0]}") from None
        for name in adapters[1:]:
            self.lm.add_adapter(name, lora)
        self.adapters = tuple(adapters)
        self.lm.base_model.set_adapter(list(adapters))  # all active: their outputs add up (weighted, see below)
        for n, p in self.lm.named_parameters():  # only the adapters train; the base stays frozen
            p.requires_grad_(".lora_" in n)
        self._weights: dict[str, Tensor | float] = {}
        for name, module in self._lora_b_modules():
            module.register_forward_hook(functools.partial(self._weigh, name))

    def _lora_b_modules(self) -> Iterator[tuple[str, nn.Module]]:
        from peft.tuners.lora import LoraLayer

        for module in self.lm.modules():
            if isinstance(module, LoraLayer):
                yield from module.lora_B.items()

    def _weigh(self, adapter: str, module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
        w = self._weights.get(adapter)
        if w is None:
            return None
        if isinstance(w, Tensor):
            w = w.reshape(-1, *([1] * (output.dim() - 1)))
        return output * w

    @contextlib.contextmanager
    def adapter_weights(self, weights: Mapping[str, Tensor | float]) -> Iterator[None]:
        """Scale each adapter's low-rank update ``B A x`` by a number or a per-instance ``[B]`` weight inside
        the block (FedDPA's instance-wise combination; weight 0 switches an adapter off)."""
        unknown = set(weights) - set(self.adapters)
        if unknown:
            raise ValueError(f"unknown adapters {sorted(unknown)}; this network has {list(self.adapters)}")
        saved, self._weights = self._weights, {**self._weights, **weights}
        try:
            yield
        finally:
            self._weights = saved

    def forward(self, x: Tensor) -> Tensor:
        mask = (x != self.pad_token_id).long()
        hidden = self.lm(input_ids=x, attention_mask=mask).last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        if self.pooling == "last":
            last = mask.sum(1).clamp_min(1) - 1
            return hidden[torch.arange(x.shape[0], device=x.device), last]
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class LoRAClassifier(SplitModel):
    """``head(φ(x))``: a pretrained (or config-built) transformer with LoRA adapters, pooled, and a linear head.

    Args:
        num_labels: classes of the task (the head's outputs).
        model, config: the checkpoint (a folder or ``package:NAME``) or a random-init config (one of them).
        adapters: adapter names (FedDPA: ``[global, local]``); all active, their updates added.
        rank, alpha, lora_dropout, target_modules: peft's ``LoraConfig`` (``target_modules`` None: peft's default
            for the architecture, e.g. BERT's query and value).
        pooling, pad_token_id, base_dropout: see ``PooledLoRAEncoder``.
        layers: keep only the first ``layers`` transformer layers of the checkpoint (their pretrained weights; a
            cheaper, truncated model); None keeps all.
    """

    def __init__(
        self,
        num_labels: int,
        model: str | None = None,
        config: dict[str, Any] | None = None,
        adapters: Sequence[str] = ("default",),
        rank: int = 8,
        alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: list[str] | None = None,
        pooling: Literal["mean", "cls", "last"] = "mean",
        pad_token_id: int | None = None,
        base_dropout: float = 0.0,
        layers: int | None = None,
    ) -> None:
        body = PooledLoRAEncoder(model, config, adapters, rank, alpha, lora_dropout, target_modules, pooling,
                                 pad_token_id, base_dropout, layers)  # fmt: skip
        hidden = int(body.lm.base_model.model.config.hidden_size)
        super().__init__(body, nn.Linear(hidden, num_labels))
        self._engine_attributes(lora_dropout)

    def _engine_attributes(self, lora_dropout: float) -> None:
        """What the engine reads of a LoRA split model (after ``body`` and ``head`` are set)."""
        #: the executor's stacked path trains a cohort's adapters in one step over the one base (``stacked_forward``);
        #: LoRA dropout would draw per client, so with it the clients run in the loop (``executor._blocker``)
        self.stacked_blocker = "LoRA dropout runs one client at a time" if lora_dropout > 0 else None
        #: scoring stacks whole client models (one base copy per client): evaluation runs in the loop
        self.stacked_scoring_blocker = "a LoRA network scores one client at a time"
        #: said in the executor's decision when the stacked path trains this network
        self.stacked_note = "LoRA adapters stacked over one frozen base"
        #: checkpoints hold the adapters and the head only; the frozen base is rebuilt from its source on resume
        #: (``engine.checkpoint``: a fingerprint of each base tensor refuses another base)
        self.checkpoint_frozen = False
        #: the transformer's buffers (position and token-type ids) are constants: never uploaded nor sent
        self.constant_buffers = tuple(f"body.{n}" for n, _ in self.body.named_buffers())

    @property
    def adapters(self) -> tuple[str, ...]:
        return self.body.adapters

    def adapter_weights(self, weights: Mapping[str, Tensor | float]) -> contextlib.AbstractContextManager[None]:
        return self.body.adapter_weights(weights)

    def stacked_forward(self, params: Mapping[str, Tensor], x: Tensor) -> Tensor:
        """K clients' logits ``[K, B, C]`` on ``x`` ``[K, B, L]`` with their stacked adapters and heads over the one
        frozen base: ``models.stacked_lora.stacked_forward`` (the engine's stacked step calls it)."""
        from fl_lightning.models.stacked_lora import stacked_forward

        return stacked_forward(self, params, x)
