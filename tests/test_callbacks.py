"""``fl_lightning.callbacks.RoundCheckpoint``: the rounds it saves, with Lightning's ``on_validation_end`` or ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.algorithms import FedAvg
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.training import fit


def _saved(folder: Path, monkeypatch: pytest.MonkeyPatch, lightnings: bool, **eval_every) -> tuple[dict, int]:
    if lightnings:
        monkeypatch.setattr(RoundCheckpoint, "on_validation_end", ModelCheckpoint.on_validation_end)
    copies = []
    original = ModelCheckpoint._monitor_candidates
    monkeypatch.setattr(RoundCheckpoint, "_monitor_candidates", lambda self, t: copies.append(1) or original(self, t))
    checkpoint = RoundCheckpoint(
        dirpath=folder, filename="round{step:05d}", auto_insert_metric_name=False, every_n_train_steps=3,
        save_top_k=2, monitor="step", mode="max", save_last=True,
    )  # fmt: skip
    fit(FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)), **eval_every), digits(), rounds=7,
        enable_checkpointing=True, callbacks=[checkpoint])  # fmt: skip
    monkeypatch.undo()
    files = {p.name: torch.load(p, weights_only=False)["global_step"] for p in sorted(folder.glob("*.ckpt"))}
    return files, len(copies)


@pytest.mark.parametrize("eval_every", [{}, {"eval_every": 2, "eval_last": 1}])
def test_the_same_checkpoints_as_lightnings_own_validation_end(tmp_path, monkeypatch, eval_every) -> None:
    """Every 3 rounds (top 2 kept) and last, evaluated every round or every other one: the same files of the same
    rounds as with ``ModelCheckpoint.on_validation_end``, without its metric copy on the rounds that save nothing."""
    ours, our_copies = _saved(tmp_path / "ours", monkeypatch, False, **eval_every)
    lightnings, their_copies = _saved(tmp_path / "lightning", monkeypatch, True, **eval_every)
    assert ours == lightnings == {"round00003.ckpt": 3, "round00006.ckpt": 6, "last.ckpt": 7}
    assert our_copies < their_copies
