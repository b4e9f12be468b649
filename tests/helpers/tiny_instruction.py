"""Per-client instruction data in the real on-disk formats (FedDPA's JSON files, ``datasets`` folders), its
tokenizer (``experiments.instructions``: records and a WordLevel tokenizer with EOS) and a tiny random LLaMA
config: no download."""

from __future__ import annotations

from pathlib import Path

from experiments.instructions import records, write_data, write_tokenizer

__all__ = ["records", "tiny_llama_config", "write_data", "write_instruction_hf", "write_tokenizer"]


def tiny_llama_config(vocab_size: int = 96) -> dict:
    return dict(model_type="llama", vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                bos_token_id=None, eos_token_id=2)  # fmt: skip


def write_instruction_hf(root: Path, clients: int = 4, train: int = 6, test: int = 3, seed: int = 0) -> Path:
    """``client_<i>/``: a ``DatasetDict`` (train, test) saved with ``save_to_disk``; ``input`` "" where absent."""
    from datasets import Dataset, DatasetDict

    for c in range(clients):
        splits = {}
        for split, n, s in (("train", train, seed), ("test", test, seed + 100)):
            splits[split] = Dataset.from_list([{"input": "", **r} for r in records(c, n, s)])
        DatasetDict(splits).save_to_disk(str(root / f"client_{c}"))
    return root
