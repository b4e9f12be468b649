"""``InstructionDataModule`` (``datamodules/instruction.py``) on per-client files written here in the real formats
(FedDPA's ``local_training_<i>.json`` / ``local_test_<i>.json``, and ``datasets`` save_to_disk folders): the causal-LM
examples equal the authors' recipe written out in the test (Alpaca prompt + output, EOS appended, the prompt's labels
-100), each unmasked label becomes one next-token sample, both layouts give the same data, and a bad file or field is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from datamodules.instruction import IGNORE, InstructionDataModule, causal_examples, next_token_samples
from fl_lightning.errors import ConfigError
from tests.helpers.tiny_instruction import records, write_data, write_instruction_hf, write_tokenizer

FIELDS = ("instruction", "input", "output")
PROMPT_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n"
                     "### Input:\n{}\n\n### Response:\n")  # fmt: skip
PROMPT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{}\n\n### Response:\n")  # fmt: skip


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok")))


def test_examples_follow_the_authors_recipe(tok) -> None:
    """With an input and without: ids = tokens(prompt + output) + [EOS]; labels -100 over the prompt's tokens."""
    recs = [{"instruction": "is it a pet ?", "input": "a red cat", "output": "answer yes"},
            {"instruction": "name the color of the animal a blue fish", "output": "blue"}]  # fmt: skip
    got = causal_examples(tok, recs, 64, FIELDS)
    prompts = [PROMPT_WITH_INPUT.format("is it a pet ?", "a red cat"), PROMPT.format("name the color of the animal a "
                                                                                   "blue fish")]  # fmt: skip
    for (ids, labels), prompt, rec in zip(got, prompts, recs):
        want = tok(prompt + rec["output"])["input_ids"] + [tok.eos_token_id]
        n = len(tok(prompt)["input_ids"])
        assert ids == want and labels == [IGNORE] * n + want[n:]
        assert tok.decode(want[n:]) == rec["output"] + " </s>"
        assert "[UNK]" not in tok.convert_ids_to_tokens(ids)


def test_truncation_keeps_max_length_tokens_and_appends_no_eos(tok) -> None:
    rec = {"instruction": "is it a pet ?", "input": "a red cat", "output": "answer yes"}
    full, _ = causal_examples(tok, [rec], 64, FIELDS)[0]
    ids, labels = causal_examples(tok, [rec], len(full) - 2, FIELDS)[0]  # cut inside the response
    assert ids == full[: len(full) - 2] and tok.eos_token_id not in ids
    assert [t for t in labels if t != IGNORE] == [full[-3]]  # "answer" is left, "yes" and EOS are cut
    ids, labels = causal_examples(tok, [rec], 10, FIELDS)[0]  # inside the prompt: nothing to learn
    assert len(ids) == 10 and set(labels) == {IGNORE}


def test_each_unmasked_label_is_one_sample_with_its_prefix_right_padded() -> None:
    examples = [([5, 6, 7, 8], [IGNORE, IGNORE, 7, 8]), ([9, 10], [IGNORE, 10])]
    x, y = next_token_samples(examples, 5, pad=0)
    assert x.tolist() == [[5, 6, 0, 0, 0], [5, 6, 7, 0, 0], [9, 0, 0, 0, 0]] and y.tolist() == [7, 8, 10]


def test_json_and_hf_layouts_give_the_same_clients(tmp_path) -> None:
    """FedDPA's JSON files and ``datasets`` folders of the same records (``input`` "" where the JSON has none)
    give the same samples per client; sizes count response tokens (+ EOS) per client."""
    root = write_data(tmp_path / "json", clients=3, train=5, test=2)
    write_instruction_hf(tmp_path / "hf", clients=3, train=5, test=2)
    tok = str(root / "tokenizer")
    feds = []
    for fmt, path in (("json", root), ("hf", tmp_path / "hf")):
        dm = InstructionDataModule(str(path), tok, format=fmt, num_clients=3, max_length=64)
        dm.setup()
        feds.append(dm.federated)
    a, b = feds
    for split in ("train", "test"):
        sa, sb = getattr(a, split), getattr(b, split)
        assert torch.equal(sa.x, sb.x) and torch.equal(sa.y, sb.y) and torch.equal(sa.ptr, sb.ptr)
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    for c in range(3):  # per client: the response tokens of its records and one EOS each
        want = sum(len(t(r["output"])["input_ids"]) + 1 for r in records(c, 5, 0))
        assert int(a.train.sizes[c]) == want
    assert a.num_classes == len(t)


def test_bad_files_and_fields_are_refused_in_one_line(tmp_path) -> None:
    root = write_data(tmp_path / "d", clients=2, train=3, test=2)
    tok = str(root / "tokenizer")
    with pytest.raises(ConfigError, match="no file local_training_2.json"):
        InstructionDataModule(str(root), tok, num_clients=3).setup()
    (root / "local_test_1.json").write_text(json.dumps([{"instruction": "x"}]))
    with pytest.raises(ConfigError, match="has no field 'output'"):
        InstructionDataModule(str(root), tok, num_clients=2).setup()
    with pytest.raises(ConfigError, match="num_classes=3 but a train token"):
        InstructionDataModule(str(write_data(tmp_path / "e", clients=2)), tok, num_clients=2, num_classes=3).setup()
