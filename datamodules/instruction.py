"""Instruction data per client from disk, tokenised into causal-LM examples with the model's tokenizer (issue 43).

The layouts of ``datamodules.adapter_text`` (``data.path``):

* ``format: json``: FedDPA's per-client files (Yang et al., NeurIPS 2024; authors' code, Lydia-yang/FedDPA
  ``code/fed_utils/client.py``: ``local_training_<i>.json``, read with ``load_dataset("json")``), a list of records
  with ``instruction``, ``input`` (optional) and ``output``; the test records in ``local_test_<i>.json``;
* ``format: hf``: one ``datasets`` ``save_to_disk`` folder per client, ``client_<i>/`` with ``train`` and ``test``.

Each record becomes one causal-LM example as the authors' ``generate_and_tokenize_prompt`` (``code/main.py``) builds
it: the Alpaca prompt (their default template) with the instruction (and the input, when there is one), then the
output; tokenised with the model's tokenizer, truncated to ``max_length`` tokens, the EOS token appended when it fits;
labels = the tokens, with the prompt's positions masked (-100, ``train_on_inputs: False``). ``causal_examples`` gives
these.

The engine trains on samples ``(x, y)``; an example gives one sample per unmasked label: ``x`` = the tokens before
it (right-padded to ``max_length``), ``y`` = the token. With ``models.LoRACausalLM`` (the LM's logits of the token
after ``x``), the engine's mean cross-entropy over a client's samples is the causal-LM loss over its unmasked
tokens, its accuracy the next-token accuracy (teacher forcing) and exp(loss) the perplexity; a sample's forward
reads its prefix again (one forward per target token rather than one per example: the same numbers, more compute,
fine for short responses).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from datamodules.adapter_text import TextClassificationDataModule, load_tokenizer
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError

__all__ = ["IGNORE", "InstructionDataModule", "alpaca_prompt", "causal_examples", "next_token_samples"]

IGNORE = -100  #: the label of a position that is not trained on (the prompt), as in Hugging Face's losses

#: the Alpaca template (tatsu-lab/stanford_alpaca), the prompt template of FedDPA's and FedIT's scripts
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n"
                "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")  # fmt: skip
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
          "\n\n### Instruction:\n{instruction}\n\n### Response:\n")  # fmt: skip


def alpaca_prompt(instruction: str, input: str | None = None) -> str:
    """The prompt before the response (with the input section only when ``input`` is not empty)."""
    if input:
        return ALPACA_INPUT.format(instruction=instruction, input=input)
    return ALPACA.format(instruction=instruction)


def causal_examples(
    tokenizer: Any, records: list[dict[str, Any]], max_length: int, fields: tuple[str, str, str]
) -> list[tuple[list[int], list[int]]]:
    """``(token ids, labels)`` per record: prompt + output tokenised, truncated to ``max_length``, EOS appended
    when shorter and not already last; labels the ids with the prompt's positions ``IGNORE``."""
    instruction, inp, output = fields
    eos = tokenizer.eos_token_id
    out = []
    for r in records:
        prompt = alpaca_prompt(str(r[instruction]), str(r.get(inp) or "") or None)
        ids = tokenizer(prompt + str(r[output]), truncation=True, max_length=max_length)["input_ids"]
        if eos is not None and len(ids) < max_length and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        masked = len(tokenizer(prompt, truncation=True, max_length=max_length)["input_ids"])
        out.append((ids, [IGNORE] * masked + ids[masked:]))
    return out


def next_token_samples(examples: list[tuple[list[int], list[int]]], max_length: int, pad: int) -> tuple[Tensor, Tensor]:
    """``x`` ``[N, max_length]`` (the tokens before each unmasked label, right-padded with ``pad``) and ``y`` ``[N]``
    (the label): one sample per position ``t ≥ 1`` whose label is not ``IGNORE``."""
    xs, ys = [], []
    for ids, labels in examples:
        for t in range(1, len(ids)):
            if labels[t] != IGNORE:
                xs.append(ids[:t] + [pad] * (max_length - t))
                ys.append(labels[t])
    if not xs:
        return torch.zeros(0, max_length, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.tensor(xs, dtype=torch.long), torch.tensor(ys, dtype=torch.long)


class InstructionDataModule(TextClassificationDataModule):
    """Per-client instruction data read from ``path`` (layouts above), as next-token samples for ``LoRACausalLM``.

    Args:
        path, tokenizer, format: as ``TextClassificationDataModule`` (``format`` default ``json``: FedDPA's files).
        instruction_column, input_column, output_column: the record fields (FedDPA's: instruction, input, output;
            a record without the input field has none).
        max_length: tokens per example (the authors' ``cutoff_len``), prompt and response together.
        num_classes: the vocabulary size the labels index (default: the tokenizer's, ``len(tokenizer)``); at most the
            model's vocabulary.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str,
        format: Literal["hf", "json"] = "json",
        instruction_column: str = "instruction",
        input_column: str = "input",
        output_column: str = "output",
        max_length: int = 64,
        num_classes: int | None = None,
        num_clients: int = 8,
        clients_per_round: int | None = None,
        participation: float | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(path, tokenizer, format, instruction_column, output_column, max_length, num_classes,
                         num_clients, clients_per_round, participation, seed)  # fmt: skip
        self.input_column = input_column

    def build(self) -> FederatedData:
        tok = load_tokenizer(self.tokenizer)
        if tok.pad_token_id is None:
            raise ConfigError(f"data.tokenizer '{self.tokenizer}' has no padding token; set one when saving it")
        fields = (self.text_column, self.input_column, self.label_column)
        vocab = self.num_classes or len(tok)
        tensors = {}
        for split in ("train", "test"):
            xs, ys, sizes = [], [], []
            for c in range(self.num_clients):
                records = self.client_records(c, split)
                for column in (self.text_column, self.label_column):
                    self._column(records, column, f"client {c} {split}")
                x, y = next_token_samples(causal_examples(tok, records, self.max_length, fields), self.max_length,
                                          tok.pad_token_id)  # fmt: skip
                xs.append(x)
                ys.append(y)
                sizes.append(len(y))
            y = torch.cat(ys)
            if y.numel() and int(y.max()) >= vocab:
                raise ConfigError(f"data.num_classes={vocab} but a {split} token has id {int(y.max())}")
            ptr = torch.tensor([0, *sizes]).cumsum(0)
            tensors[split] = (torch.cat(xs), y, [torch.arange(int(ptr[c]), int(ptr[c + 1]))
                                                 for c in range(self.num_clients)])  # fmt: skip
        return self.make_federated(*tensors["train"], *tensors["test"], vocab)
