"""``python -m experiments adapters`` (``experiments/adapters.py``): the example covers every shipped adapter method,
its sentences' labels follow each client's rule, the data are reproducible, and a finished run is reused."""

from __future__ import annotations

import json
import random
from pathlib import Path

from experiments import adapters
from tests.helpers.split_models import ROOT


def test_the_example_covers_every_shipped_method():
    files = (ROOT / "configs" / "adapters").glob("*.yaml")
    classification = [p for p in files if not p.stem.startswith("instruction_")]
    shipped = sorted(p.stem for p in classification if p.stem != "base")  # instruction_*: the causal-LM example
    assert set(shipped) == set(adapters.METHODS) and len(shipped) >= 8


def test_half_the_clients_label_by_the_noun_the_other_half_by_the_adjective():
    half = adapters.CLIENTS // 2
    for client in range(adapters.CLIENTS):
        for positive in (False, True):
            for animal in (False, True):
                expected = int(animal) if client < half else int(positive)
                assert adapters.label(client, positive, animal) == expected
    for client in (0, adapters.CLIENTS - 1):
        for row in adapters.sentences(client, 40, random.Random(client)):
            words = set(row["text"].replace(".", " ").split())
            animal, positive = bool(words & set(adapters.ANIMALS)), bool(words & set(adapters.POSITIVE))
            assert animal != bool(words & set(adapters.VEHICLES)) and positive != bool(words & set(adapters.NEGATIVE))
            assert row["label"] == adapters.label(client, positive, animal)
    assert adapters.sentences(3, 5, random.Random(1)) == adapters.sentences(3, 5, random.Random(1))


def test_a_finished_run_is_reused_and_an_unfinished_one_not_trained_when_asked(tmp_path: Path):
    run_dir = tmp_path / "runs" / "fedit_seed2_r3"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"final": 0.75}))
    assert adapters.run_one("fedit", 2, 3, tmp_path / "data", tmp_path / "runs") == {"final": 0.75}
    assert adapters.run_one("fedit", 0, 3, tmp_path / "data", tmp_path / "runs", train=False) is None
