"""``python -m experiments instructions`` (``experiments/instructions.py``) writes FedDPA's per-client files (JSON lists
of instruction/input/output records, the test records apart) and a tokenizer that covers every word of the prompts
and the responses; the clients follow their rules."""

from __future__ import annotations

import json

from experiments.instructions import PETS, main


def test_the_command_writes_feddpas_layout_and_a_covering_tokenizer(tmp_path, capsys) -> None:
    from transformers import AutoTokenizer

    from datamodules.instruction import alpaca_prompt

    assert main(["--out", str(tmp_path / "d"), "--clients", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"data: {tmp_path / 'd'}"
    names = sorted(p.name for p in (tmp_path / "d").glob("*.json"))
    assert names == ["local_test_0.json", "local_test_1.json", "local_training_0.json", "local_training_1.json"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "d" / "tokenizer")
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 2)
    for c in range(2):
        recs = json.loads((tmp_path / "d" / f"local_training_{c}.json").read_text())
        assert len(recs) == 24 and sum("input" not in r for r in recs) == 8
        for r in recs:
            animal = (r.get("input") or r["instruction"]).split()[-1]
            color = (r.get("input") or r["instruction"]).split()[-2]
            assert r["output"] == (color if c == 0 else f"answer {'yes' if animal in PETS else 'no'}")
            text = alpaca_prompt(r["instruction"], r.get("input")) + r["output"]
            assert "[UNK]" not in tok.convert_ids_to_tokens(tok(text)["input_ids"])


def test_no_clients_is_refused_in_one_line_and_writes_nothing(tmp_path, capsys) -> None:
    from experiments.instructions import main

    assert main(["--clients", "0", "--out", str(tmp_path / "data")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --clients 0: expected at least 1 client"]
    assert list(tmp_path.iterdir()) == []
