"""Tiny randomly initialised transformers with LoRA adapters, a WordLevel tokenizer trained here, and per-client
text files in the real on-disk formats (``datasets`` save_to_disk folders, FedDPA's JSON files): no download."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from fl_lightning.models.adapters import LoRAClassifier

COLORS = ["red", "blue", "green", "black"]
ANIMALS = ["cat", "dog", "bird", "fish"]
PLACES = ["house", "park", "river", "street"]
WORDS = COLORS + ANIMALS + PLACES + ["the", "a", "in", "near", "sees"]


def tiny_config(vocab_size: int = 32) -> dict:
    return dict(model_type="bert", vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=24, max_position_embeddings=32, pad_token_id=0, type_vocab_size=1)  # fmt: skip


def tiny_net(adapters=("default",), rank: int = 4, num_labels: int = 2, seed: int = 0, **kw) -> LoRAClassifier:
    """A 2-layer BERT (hidden 16) with LoRA on query and value, built from ``seed``; B drawn non-zero so the
    adapters change outputs from the start (peft initialises B = 0)."""
    torch.manual_seed(seed)
    net = LoRAClassifier(num_labels, config=tiny_config(), adapters=adapters, rank=rank, alpha=2.0 * rank,
                         target_modules=["query", "value"], **kw)  # fmt: skip
    return draw_lora_b(net, seed + 1)


def draw_lora_b(net: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Every LoRA B of ``net`` drawn ``scale``·N(0, 1) from ``seed`` (peft starts B at 0, where the adapters would
    not change the outputs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if ".lora_B." in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return net


def token_batch(n: int = 6, length: int = 7, seed: int = 0, vocab: int = 32) -> torch.Tensor:
    """Token ids in [2, vocab) with a padded tail (id 0) on every other row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, vocab, (n, length), generator=g)
    x[::2, length - 2 :] = 0
    return x


def write_tokenizer(folder: Path) -> Path:
    """A WordLevel tokenizer over ``WORDS`` ([PAD] = 0, [UNK] = 1), saved as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(str(folder))
    return folder


def sentences(n: int, seed: int) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    return [(rng.choice(COLORS), rng.choice(ANIMALS), rng.choice(PLACES)) for _ in range(n)]


def label_of(client: int, color: str, animal: str, place: str) -> int:
    """Clients follow different rules over the same kind of text: even clients label by the animal (cat/dog → 1),
    odd clients by the colour (red/blue → 1)."""
    return int(animal in ANIMALS[:2]) if client % 2 == 0 else int(color in COLORS[:2])


def client_records(client: int, n: int, seed: int) -> list[dict]:
    return [
        {"text": f"the {c} {a} sees a {p}", "label": label_of(client, c, a, p)}
        for c, a, p in sentences(n, 1000 * seed + client)
    ]


def write_clients_hf(root: Path, clients: int = 4, train: int = 12, test: int = 6, seed: int = 0) -> Path:
    from datasets import Dataset, DatasetDict

    for c in range(clients):
        data = DatasetDict(
            train=Dataset.from_list(client_records(c, train, seed)),
            test=Dataset.from_list(client_records(c, test, seed + 100)),
        )
        data.save_to_disk(str(root / f"client_{c}"))
    return root


def write_clients_json(root: Path, clients: int = 4, train: int = 12, test: int = 6, seed: int = 0,
                       text: str = "instruction", label: str = "output") -> Path:  # fmt: skip
    """FedDPA's layout (``local_training_<i>.json``; the test records in ``local_test_<i>.json``), string labels."""
    root.mkdir(parents=True, exist_ok=True)
    for c in range(clients):
        for split, n, s in (("training", train, seed), ("test", test, seed + 100)):
            records = [{text: r["text"], label: ["no", "yes"][r["label"]], "category": "rule"}
                       for r in client_records(c, n, s)]  # fmt: skip
            (root / f"local_{split}_{c}.json").write_text(json.dumps(records))
    return root
