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


def _round_checkpoint(folder: Path, every: int) -> RoundCheckpoint:
    """As train.py makes it (``fl_lightning.cli``): every ``every`` rounds, the 2 newest kept, and ``last.ckpt``."""
    return RoundCheckpoint(
        dirpath=folder, filename="round{step:05d}", auto_insert_metric_name=False, every_n_train_steps=every,
        save_top_k=2, monitor="step", mode="max", save_last=True,
    )  # fmt: skip


def _module() -> FederatedModule:
    return FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)), eval_every=2, eval_last=1)


def _counting_saves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """(global step, file name) of every checkpoint serialised (``TorchCheckpointIO.save_checkpoint``)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    saves: list[tuple[int, str]] = []
    original = TorchCheckpointIO.save_checkpoint

    def counted(self, checkpoint, path, storage_options=None):
        saves.append((checkpoint["global_step"], Path(path).name))
        return original(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", counted)
    return saves


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_a_save_round_serialises_once_and_last_is_that_file(tmp_path, monkeypatch) -> None:
    """Rounds 2, 4 and 6 of 7 are saved: one ``torch.save`` each (``last.ckpt`` is a hard link to the round's file),
    plus the final round's ``last.ckpt`` written in full at the end, which leaves the round file it replaced intact.
    Every file holds ``last_model_path`` = ``last.ckpt``, as a second serialisation of ``last.ckpt`` would."""
    saves = _counting_saves(monkeypatch)
    folder = tmp_path / "ckpt"
    checkpoint = _round_checkpoint(folder, 2)
    states = []
    original_link = RoundCheckpoint._save_last_checkpoint

    def after_each_last(self, trainer, candidates):  # the state of last.ckpt at each save round
        original_link(self, trainer, candidates)
        states.append((trainer.global_step, (folder / "last.ckpt").stat().st_ino, _load(folder / "last.ckpt")))

    monkeypatch.setattr(RoundCheckpoint, "_save_last_checkpoint", after_each_last)
    fit(_module(), digits(), rounds=7, enable_checkpointing=True, callbacks=[checkpoint])
    assert saves == [(2, "round00002.ckpt"), (4, "round00004.ckpt"), (6, "round00006.ckpt"), (7, "last.ckpt")]
    for step, inode, last in states[:3]:  # a link to the round file of the same step, with the same content
        round_file = folder / f"round{step:05d}.ckpt"
        assert last["global_step"] == step
        if round_file.exists():
            assert round_file.stat().st_ino == inode
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round00004.ckpt", "round00006.ckpt"]
    assert _load(folder / "round00006.ckpt")["global_step"] == 6  # not overwritten through the link
    assert _load(folder / "last.ckpt")["global_step"] == 7
    assert (folder / "last.ckpt").stat().st_nlink == 1
    for name in ("round00004.ckpt", "round00006.ckpt", "last.ckpt"):
        state = _load(folder / name)["callbacks"]
        (key,) = [k for k in state if k.startswith("RoundCheckpoint")]
        assert state[key]["last_model_path"] == str(folder / "last.ckpt"), name


def test_last_resumes_to_the_numbers_of_an_uninterrupted_run(tmp_path) -> None:
    """A run stopped after round 4 (``last.ckpt`` a link to ``round00004.ckpt``) and resumed from ``last.ckpt`` to
    round 7: the same history and weights as 7 rounds in one go, and its next ``last`` is ``last.ckpt`` again (not
    ``last-v1.ckpt``: the linked file names ``last.ckpt`` as the callback's last path)."""
    import lightning as L

    from tests.helpers.training import make_trainer

    full = fit(_module(), digits(), rounds=7)
    folder = tmp_path / "ckpt"
    fit(_module(), digits(), rounds=4, enable_checkpointing=True, callbacks=[_round_checkpoint(folder, 2)])
    assert (folder / "last.ckpt").stat().st_ino == (folder / "round00004.ckpt").stat().st_ino
    resumed = _module()
    L.seed_everything(123, verbose=False)  # a resume restores its own random state
    make_trainer(7, enable_checkpointing=True, callbacks=[_round_checkpoint(folder, 2)]).fit(
        resumed, datamodule=digits(), ckpt_path=str(folder / "last.ckpt")
    )
    assert resumed.history == full.history
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round00004.ckpt", "round00006.ckpt"]
    assert _load(folder / "last.ckpt")["global_step"] == 7


def test_without_hard_links_last_is_written_in_full(tmp_path, monkeypatch) -> None:
    """A file system without hard links: ``last.ckpt`` is serialised as Lightning does, and holds the same state as
    the linked one would (the weights and the round of the round file)."""
    import os

    def no_links(source, target):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    saves = _counting_saves(monkeypatch)
    folder = tmp_path / "ckpt"
    fit(_module(), digits(), rounds=4, enable_checkpointing=True, callbacks=[_round_checkpoint(folder, 2)])
    assert [s for s, _ in saves] == [2, 2, 4, 4]
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round00002.ckpt", "round00004.ckpt"]
    last, round4 = _load(folder / "last.ckpt"), _load(folder / "round00004.ckpt")
    assert (folder / "last.ckpt").stat().st_ino != (folder / "round00004.ckpt").stat().st_ino
    assert last["global_step"] == round4["global_step"] == 4
    for name, tensor in round4["state_dict"].items():
        assert torch.equal(last["state_dict"][name], tensor), name


def test_the_free_space_check_searches_the_folder_once(tmp_path, monkeypatch) -> None:
    """The disk check of every save after the first needs the size of the checkpoint the callback wrote last, not
    a search of the folder; it still asks the disk for its free space at every serialisation."""
    import shutil

    import fl_lightning.callbacks as callbacks

    searched, asked = [], []
    newest, usage = callbacks.newest_checkpoint, shutil.disk_usage
    monkeypatch.setattr(callbacks, "newest_checkpoint", lambda *a: searched.append(1) or newest(*a))
    monkeypatch.setattr(callbacks.shutil, "disk_usage", lambda path: asked.append(1) or usage(path))
    folder = tmp_path / "ckpt"
    fit(_module(), digits(), rounds=6, enable_checkpointing=True, callbacks=[_round_checkpoint(folder, 1)])
    assert len(searched) == 1
    assert len(asked) == 6
