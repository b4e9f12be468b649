"""Text classification per client from disk, tokenised with the model's tokenizer (issue 43).

Two on-disk layouts, one folder per run (``data.path``):

* ``format: hf``: one Hugging Face ``datasets`` folder per client, ``client_<i>/`` (``DatasetDict.save_to_disk``
  with ``train`` and ``test`` splits), ``i`` = 0 … num_clients − 1;
* ``format: json``: FedDPA's per-client JSON files (Yang et al., NeurIPS 2024, authors' code: ``data_path/
  local_training_<i>.json``, a list of records), with the test records in ``local_test_<i>.json``.

Each record has a text (``text_column``) and a label (``label_column``): integers are class ids; strings are mapped
to ids in sorted order over every client's training labels. Texts become ``[N, max_length]`` token ids with the
tokenizer of ``tokenizer`` (a checkpoint folder, or ``package:NAME`` as ``model.network.model``), padded and
truncated to ``max_length``; ``LoRAClassifier`` reads the padding as its attention mask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError

__all__ = ["TextClassificationDataModule", "load_tokenizer"]


def load_tokenizer(tokenizer: str) -> Any:
    """The tokenizer saved with a checkpoint (a folder, or ``package:NAME``; never downloaded)."""
    from transformers import AutoTokenizer

    from fl_lightning.models.adapters import resolve_model_path

    if tokenizer.startswith("package:"):
        return AutoTokenizer.from_pretrained(resolve_model_path(tokenizer))
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer '{tokenizer}': no such folder (a saved tokenizer or checkpoint)")
    return AutoTokenizer.from_pretrained(path)


def _records_hf(folder: Path, split: str) -> list[dict[str, Any]]:
    from datasets import load_from_disk

    data = load_from_disk(str(folder))
    if split not in data:
        raise ConfigError(f"data: {folder} has no '{split}' split (it has {list(data)}); save a DatasetDict with it")
    return data[split].to_list()


def _records_json(file: Path) -> list[dict[str, Any]]:
    try:
        records = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"data: {file} is not valid JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(records, list):
        raise ConfigError(f"data: {file} must hold a JSON list of records")
    return records


class TextClassificationDataModule(FederatedDataModule):
    """Per-client text classification read from ``path`` (layout above), tokenised with ``tokenizer``.

    Args:
        path: the folder of the per-client data.
        tokenizer: the model's tokenizer (a folder or ``package:NAME``).
        format: ``hf`` (``client_<i>/`` save_to_disk folders) or ``json`` (``local_training_<i>.json`` and
            ``local_test_<i>.json``).
        text_column, label_column: the record fields (FedDPA's records: ``instruction`` and ``output``).
        max_length: tokens per text (padded and truncated).
        num_classes: default: the number of distinct training labels (or max integer label + 1).
    """

    def __init__(
        self,
        path: str,
        tokenizer: str,
        format: Literal["hf", "json"] = "hf",
        text_column: str = "text",
        label_column: str = "label",
        max_length: int = 32,
        num_classes: int | None = None,
        num_clients: int = 8,
        clients_per_round: int | None = None,
        participation: float | None = None,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed, val_fraction)
        if format not in ("hf", "json"):
            raise ConfigError(f"data.format must be hf or json, got {format!r}")
        if max_length < 1:
            raise ConfigError(f"data.max_length must be ≥ 1, got {max_length}")
        self.path, self.tokenizer, self.format = path, tokenizer, format
        self.text_column, self.label_column = text_column, label_column
        self.max_length, self.num_classes = max_length, num_classes

    def client_records(self, client: int, split: str) -> list[dict[str, Any]]:
        root = Path(self.path).expanduser()
        if self.format == "hf":
            folder = root / f"client_{client}"
            if not folder.is_dir():
                raise ConfigError(f"data.path {root}: no folder client_{client} (format hf)")
            return _records_hf(folder, split)
        file = root / f"local_{'training' if split == 'train' else 'test'}_{client}.json"
        if not file.is_file():
            raise ConfigError(f"data.path {root}: no file {file.name} (format json, {self.num_clients} clients)")
        return _records_json(file)

    def _column(self, records: list[dict[str, Any]], column: str, where: str) -> list[Any]:
        missing = next((i for i, r in enumerate(records) if column not in r), None)
        if missing is not None:
            fields = sorted(records[missing])
            raise ConfigError(f"data: record {missing} of {where} has no field '{column}' (fields: {fields})")
        return [r[column] for r in records]

    def build(self) -> FederatedData:
        splits: dict[str, tuple[list[str], list[Any], list[int]]] = {}
        for split in ("train", "test"):
            texts, labels, sizes = [], [], []
            for c in range(self.num_clients):
                records = self.client_records(c, split)
                where = f"client {c} {split}"
                texts += [str(t) for t in self._column(records, self.text_column, where)]
                labels += self._column(records, self.label_column, where)
                sizes.append(len(records))
            splits[split] = (texts, labels, sizes)
        label_ids = self._label_ids(splits["train"][1] + splits["test"][1], splits["train"][1])
        num_classes = self.num_classes or (max(label_ids.values()) + 1 if label_ids else 0)
        tok = load_tokenizer(self.tokenizer)
        tensors = {}
        for split, (texts, labels, sizes) in splits.items():
            x = self.encode(tok, texts)
            y = torch.tensor([label_ids[v] for v in labels], dtype=torch.long)
            if y.numel() and int(y.max()) >= num_classes:
                raise ConfigError(f"data.num_classes={num_classes} but a {split} label has class id {int(y.max())}")
            ptr = torch.tensor([0, *sizes]).cumsum(0)
            tensors[split] = (x, y, [torch.arange(int(ptr[c]), int(ptr[c + 1])) for c in range(self.num_clients)])
        return self.make_federated(*tensors["train"], *tensors["test"], num_classes)

    def _label_ids(self, every: list[Any], train: list[Any]) -> dict[Any, int]:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in every):
            return {v: v for v in set(every)} if every else {}
        unseen = sorted({str(v) for v in every} - {str(v) for v in train})
        if unseen:
            raise ConfigError(f"data: test labels {unseen[:3]} never occur in training; every label must")
        return {v: i for i, v in enumerate(sorted(set(train), key=str))}

    def encode(self, tokenizer: Any, texts: list[str]) -> Tensor:
        """``[N, max_length]`` token ids (padded with the tokenizer's pad token, truncated)."""
        if tokenizer.pad_token_id is None:
            raise ConfigError(f"data.tokenizer '{self.tokenizer}' has no padding token; set one when saving it")
        if not texts:
            return torch.zeros(0, self.max_length, dtype=torch.long)
        enc = tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt")
        return enc["input_ids"].long()
