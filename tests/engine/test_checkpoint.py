"""``fl_lightning/engine/checkpoint.py`` with ``state.py``'s journal: host and disk banks are checkpointed
incrementally (the rows written since the previous checkpoint), and a resumed fit equals the uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from benchmarks.scale import ScaleData
from fl_lightning.algorithms import Ditto, FedAvg
from fl_lightning.engine.checkpoint import checkpoint_mismatch, identity
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.state import ClientStateBank
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.small_modules import DIGITS, FEDAVG, fedrep
from tests.helpers.training import make_trainer

N = 40


def template() -> dict[str, torch.Tensor]:
    return {"fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "steps": torch.tensor(3)}


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_each_checkpoint_journals_only_the_rows_written_since_the_last(placement: str, tmp_path: Path) -> None:
    """Three checkpoints of random writes: each journal file holds exactly the rows written since the previous
    checkpoint, and each checkpoint rebuilds its own bank (numpy reference), also after a resume that writes on."""
    rng = np.random.default_rng(0)
    ref = {n: np.stack([t.numpy()] * N) for n, t in template().items()}
    bank = ClientStateBank(template(), N, placement, tmp_path / "bank")
    journal = tmp_path / "journal"
    snapshots, checkpoints = [], []
    for _ in range(3):
        written: set[int] = set()
        for _ in range(2):
            ids = rng.choice(N, size=5, replace=False)
            values = {"fc.weight": rng.normal(size=(5, 2, 3)), "steps": rng.integers(0, 100, size=5)}
            bank.scatter(torch.from_numpy(ids), {n: torch.from_numpy(v) for n, v in values.items()})
            for n, v in values.items():
                ref[n][ids] = v
            written |= set(ids.tolist())
        meta = bank.save_journal(journal)
        newest = torch.load(journal / meta["segments"][-1], weights_only=True)
        assert sorted(newest["clients"].tolist()) == sorted(written)  # what changed, not N
        snapshots.append({n: v.copy() for n, v in ref.items()})
        checkpoints.append(meta)
    assert bank.save_journal(journal)["segments"] == checkpoints[-1]["segments"]  # nothing changed: no file

    for meta, snap in zip(checkpoints, snapshots):
        fresh = ClientStateBank(template(), N, placement, tmp_path / "fresh")
        fresh.restore_journal(meta, [])
        for n in snap:
            np.testing.assert_allclose(fresh.row(n).numpy(), snap[n], rtol=0, atol=1e-6)

    resumed = ClientStateBank(template(), N, placement, tmp_path / "resumed")  # resume from checkpoint 1, write on
    resumed.restore_journal(checkpoints[0], [])
    after = {n: v.copy() for n, v in snapshots[0].items()}
    resumed.scatter(torch.tensor([7]), {"fc.weight": torch.full((1, 2, 3), -1.0), "steps": torch.tensor([-5])})
    after["fc.weight"][7], after["steps"][7] = -1.0, -5
    again = ClientStateBank(template(), N, placement, tmp_path / "again")
    again.restore_journal(resumed.save_journal(journal), [])
    for n in after:
        np.testing.assert_allclose(again.row(n).numpy(), after[n], rtol=0, atol=1e-6)


def test_a_missing_journal_is_refused_in_one_line(tmp_path: Path) -> None:
    bank = ClientStateBank(template(), N, "host", tmp_path / "bank")
    bank.scatter(torch.tensor([1]), {n: t.unsqueeze(0) + 1 for n, t in template().items()})
    meta = bank.save_journal(tmp_path / "journal")
    (tmp_path / "journal" / meta["segments"][0]).unlink()
    with pytest.raises(ConfigError, match=r"^the checkpoint's client state \(1 journal files in .*\) is missing"):
        ClientStateBank(template(), N, "host").restore_journal(meta, [])


def ditto_module(placement: str) -> FederatedModule:
    return FederatedModule(Ditto(lam=0.5), DigitsMLP(hidden=(8,)), lr=0.05, client_state=placement, eval_last=0)


def fit(placement: str, run_dir: Path, rounds: int, ckpt: str | None = None) -> FederatedModule:
    L.seed_everything(0, verbose=False)
    module = ditto_module(placement)
    every = ModelCheckpoint(dirpath=run_dir / "checkpoints", every_n_train_steps=2, save_top_k=-1, monitor="step",
                            mode="max", filename="round{step:05d}", auto_insert_metric_name=False)  # fmt: skip
    trainer = make_trainer(rounds, enable_checkpointing=True, callbacks=[every], limit_val_batches=0,
                           default_root_dir=str(run_dir))  # fmt: skip
    trainer.fit(module, datamodule=ScaleData(num_clients=60, clients_per_round=6), ckpt_path=ckpt)
    return module


@pytest.mark.parametrize(
    "first,second", [("host", "host"), ("disk", "disk"), ("device", "host"), ("host", "device")]
)
def test_resume_after_the_process_wrote_past_its_checkpoint_equals_the_uninterrupted_run(
    first: str, second: str, tmp_path: Path
) -> None:
    """The killed run trains round 3 after the round-2 checkpoint (its bank files hold round 3's rows, as after a
    ``kill -9``); resumed from round 2 it ends where the uninterrupted run does. Either layout loads into either
    placement (a device checkpoint carries the bank whole, a host one its journal)."""
    full = fit(first, tmp_path / "full", 4)
    fit(first, tmp_path / "killed", 3)
    ckpt = tmp_path / "killed" / "checkpoints" / "round00002.ckpt"
    saved = torch.load(ckpt, weights_only=False)
    assert ("fl_client_state" in saved) == (first != "device")
    assert any(k.startswith("bank.") for k in saved["state_dict"]) == (first == "device")
    resumed = fit(second, tmp_path / "killed", 4, ckpt=str(ckpt))
    assert resumed.bank.placement == second and resumed.global_step == 4
    for n, p in full.net.named_parameters():
        torch.testing.assert_close(dict(resumed.net.named_parameters())[n], p, rtol=0, atol=0)
    for n in full.bank.names:
        torch.testing.assert_close(resumed.bank.row(n), full.bank.row(n), rtol=0, atol=0)
    rows = full.bank.row(full.bank.names[0]).flatten(1)
    assert torch.unique(rows, dim=0).shape[0] > 1  # clients trained: the bank is not the template everywhere


def test_a_journal_of_another_client_count_is_refused_in_one_line(tmp_path: Path) -> None:
    bank = ClientStateBank(template(), N, "host", tmp_path / "bank")
    meta = bank.save_journal(tmp_path / "journal")
    module = ditto_module("host")
    module.attach_data(ScaleData(num_clients=30).build())
    shapes = module.bank.shapes()
    meta["shapes"] = {k.removeprefix("bank."): [list(v.shape[1:]), str(v.dtype)] for k, v in shapes.items()}
    assert checkpoint_mismatch(module, {"state_dict": module.state_dict(), "fl_client_state": meta}) == (
        f"the checkpoint has {N} clients, this config 30"
    )


class Nets:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)


# ---- identity ----------------------------------------------------------------------------------------------
def test_identity_names_the_algorithm_and_network_classes_in_full() -> None:
    assert identity(FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))) == {"algorithm": FEDAVG, "network": DIGITS}
    tiny = identity(FederatedModule(FedAvg(1), Nets.Tiny()))
    assert tiny == {"algorithm": FEDAVG, "network": f"{__name__}.Nets.Tiny"}


# ---- checkpoint_mismatch -----------------------------------------------------------------------------------
def test_a_checkpoint_of_the_same_model_fits() -> None:
    module = fedrep(4)
    state = fedrep(4).state_dict()
    assert checkpoint_mismatch(module, {"state_dict": state}) is None  # older checkpoints: no identity
    assert checkpoint_mismatch(module, {"state_dict": state, "fl_identity": identity(module)}) is None


def test_a_checkpoint_of_another_algorithm_and_network_names_both_short() -> None:
    module = fedrep(4)
    theirs = {"algorithm": "pkg.algos.fedavg.FedAvg", "network": "pkg.models.cnn.Nets.CNN"}
    message = checkpoint_mismatch(module, {"state_dict": module.state_dict(), "fl_identity": theirs})
    assert message == "the checkpoint was trained with FedAvg on CNN, this config is FedRep on DigitsMLP"


def test_a_checkpoint_identity_without_module_paths_is_named_as_is() -> None:
    module = fedrep(4)
    theirs = {"algorithm": "FedAvg", "network": "CNN"}  # written by hand, not by identity()
    message = checkpoint_mismatch(module, {"state_dict": module.state_dict(), "fl_identity": theirs})
    assert message == "the checkpoint was trained with FedAvg on CNN, this config is FedRep on DigitsMLP"


def test_a_checkpoint_with_missing_or_unexpected_entries() -> None:
    module = fedrep(4)
    keys = list(module.state_dict())  # net.body.fc1.weight, net.body.fc1.bias, net.head.weight, ...
    assert len(keys) >= 4
    assert checkpoint_mismatch(module, {}) == (
        f"the checkpoint does not fit this model (missing: {keys[:3]}, unexpected: [])"
    )
    saved = dict(module.state_dict())
    del saved[keys[1]]
    assert checkpoint_mismatch(module, {"state_dict": saved}) == (
        f"the checkpoint does not fit this model (missing: {[keys[1]]}, unexpected: [])"
    )
    extra = {**module.state_dict(), **{f"x{i}": torch.zeros(1) for i in range(5)}}
    assert checkpoint_mismatch(module, {"state_dict": extra}) == (
        "the checkpoint does not fit this model (missing: [], unexpected: ['x0', 'x1', 'x2'])"
    )


def test_a_checkpoint_with_another_number_of_clients() -> None:
    assert checkpoint_mismatch(fedrep(4), {"state_dict": fedrep(5).state_dict()}) == (
        "the checkpoint has 5 clients, this config 4"
    )


def test_a_checkpoint_with_another_layer_size_names_the_first_entry() -> None:
    message = checkpoint_mismatch(fedrep(4, hidden=4), {"state_dict": fedrep(4, hidden=5).state_dict()})
    assert message == (
        "the checkpoint does not fit this model: net.body.fc1.weight has shape [5, 64] there and [4, 64] here"
    )


def test_a_bank_entry_whose_row_shape_differs_is_a_shape_error() -> None:
    module = fedrep(4)
    saved = dict(module.state_dict())
    saved["bank.head__weight"] = torch.zeros(4, 10, 3)
    assert checkpoint_mismatch(module, {"state_dict": saved}) == (
        "the checkpoint does not fit this model: bank.head__weight has shape [4, 10, 3] there and [4, 10, 4] here"
    )


def test_a_lora_checkpoint_holds_adapters_and_head_only_and_resumes_exactly(tmp_path):
    """Issue 43: a ``LoRAClassifier`` run's checkpoint leaves the frozen base out (a fingerprint of each tensor
    instead); resuming rebuilds it from the config and gives the uninterrupted run's numbers; another base is
    refused."""

    from fl_lightning.algorithms.fedsa_lora import FedSALoRA
    from fl_lightning.errors import ConfigError
    from tests.helpers.lora_runs import module, text_data
    from tests.helpers.tiny_lora import tiny_net
    from tests.helpers.training import make_trainer

    def run(rounds, ckpt=None, seed=0, save=None):
        L.seed_everything(0, verbose=False)
        m = module(FedSALoRA(), tiny_net(seed=seed))
        trainer = make_trainer(rounds, limit_val_batches=0, default_root_dir=str(tmp_path / "run"))
        trainer.fit(m, datamodule=text_data(tmp_path / f"d{rounds}{seed}{ckpt is None}"), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return m

    path = str(tmp_path / "r2.ckpt")
    first = run(2, save=path)
    saved = torch.load(path, weights_only=False)
    base = [n for n, p in first.net.named_parameters() if not p.requires_grad]
    assert base and not any(f"net.{n}" in saved["state_dict"] for n in base)
    assert set(saved["fl_frozen"]) == set(base)
    kept = {k for k in saved["state_dict"] if k.startswith("net.")}
    assert kept == {f"net.{n}" for n, p in first.net.named_parameters() if p.requires_grad}
    resumed, straight = run(3, ckpt=path), run(3)
    for (n, a), (_, b) in zip(resumed.net.named_parameters(), straight.net.named_parameters()):
        assert torch.equal(a, b), n
    for n in straight.bank.names:
        assert torch.equal(resumed.bank.gather(torch.arange(4))[n], straight.bank.gather(torch.arange(4))[n]), n
    with pytest.raises(ConfigError, match="another base model"):
        run(3, ckpt=path, seed=1)
