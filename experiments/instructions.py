"""Per-client instruction data in FedDPA's layout, written here, for ``configs/adapters/instruction_*.yaml`` (issue 43).

``python -m experiments instructions [--out data/instructions] [--clients 4]`` writes ``local_training_<i>.json`` and
``local_test_<i>.json`` (FedDPA's per-client files: lists of ``instruction``/``input``/``output`` records) and a
WordLevel tokenizer over the task's words and the Alpaca prompt's (``tokenizer/``, with [PAD] = 0 and EOS ``</s>``),
then prints the folder. No instruction corpus or pretrained causal LM is available offline here, so the task is
generated from word lists and the shipped configs build a small randomly initialised LLaMA (``model.network.config``);
give ``model.network.model`` a checkpoint folder (and ``data.tokenizer`` its tokenizer) to tune a pretrained one.

The task: clients answer questions about "a <colour> <animal>" by different rules: even clients name its colour,
odd clients say whether it is a pet ("answer yes" for cats and dogs). Every third record has no ``input`` (the
question carries the animal), as FedDPA's data mixes both prompt forms.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

COLORS = ["red", "blue", "green", "black", "white", "brown"]
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "goat"]
PETS = {"cat", "dog"}
WORDS = ["name", "the", "color", "of", "animal", "is", "it", "a", "pet", "?", "answer", "yes", "no"]


def records(client: int, n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records of ``client`` (its rule by parity), drawn from ``(seed, client)``."""
    rng = random.Random(1000 * seed + client)
    out = []
    for i in range(n):
        color, animal = rng.choice(COLORS), rng.choice(ANIMALS)
        if client % 2 == 0:
            record = {"instruction": "name the color of the animal", "input": f"a {color} {animal}", "output": color}
        else:
            answer = "yes" if animal in PETS else "no"
            record = {"instruction": "is it a pet ?", "input": f"a {color} {animal}", "output": f"answer {answer}"}
        if i % 3 == 2:  # the animal in the question, no input field
            record["instruction"] += f" a {color} {animal}"
            del record["input"]
        out.append(record)
    return out


def write_tokenizer(folder: Path) -> Path:
    """A WordLevel tokenizer ([PAD] = 0, [UNK] = 1, </s> = 2) over the task's and the Alpaca prompts' words, split
    as its Whitespace pre-tokenizer splits them."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from datamodules.instruction import ALPACA, ALPACA_INPUT

    words = sorted(set(COLORS + ANIMALS + WORDS + re.findall(r"\w+|[^\w\s]+", ALPACA + ALPACA_INPUT)))
    vocab = {"[PAD]": 0, "[UNK]": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return folder


def write_data(root: Path, clients: int = 4, train: int = 24, test: int = 12, seed: int = 0) -> Path:
    """FedDPA's files for ``clients`` clients under ``root``, and the tokenizer in ``root/tokenizer``."""
    root.mkdir(parents=True, exist_ok=True)
    for c in range(clients):
        for split, n, s in (("training", train, seed), ("test", test, seed + 100)):
            (root / f"local_{split}_{c}.json").write_text(json.dumps(records(c, n, s), indent=1))
    write_tokenizer(root / "tokenizer")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments instructions", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("data/instructions"))
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    if args.clients < 1:
        print(f"error: --clients {args.clients}: expected at least 1 client", file=sys.stderr)  # nothing written
        return 2
    print(f"data: {write_data(args.out, args.clients)}")
    return 0
