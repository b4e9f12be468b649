"""Short engine runs of the adapter methods on per-client text written in the real format (tiny BERT, no download)."""

from __future__ import annotations

from pathlib import Path

from datamodules.adapter_text import TextClassificationDataModule
from fl_lightning.engine.module import FederatedModule
from tests.helpers.lora_refs import LR, MOMENTUM
from tests.helpers.tiny_lora import write_clients_hf, write_tokenizer


def text_data(tmp_path: Path, clients: int = 4, per_round: int | None = None, train: int = 12, seed: int = 0):
    root = write_clients_hf(tmp_path / "data", clients=clients, train=train)
    tok = write_tokenizer(tmp_path / "tokenizer")
    return TextClassificationDataModule(str(root), str(tok), num_clients=clients, max_length=8,
                                        clients_per_round=per_round or clients, seed=seed)  # fmt: skip


def module(algorithm, net, **kw) -> FederatedModule:
    kw = {"lr": LR, "momentum": MOMENTUM, "batch_size": 10_000, "eval_last": 1, **kw}
    return FederatedModule(algorithm, net, **kw)
