"""``experiments/perfedsi.py``'s setting through the engine (issue 5): what the mask model's uploads reveal (z itself
stays on the client; the declarations are tested in properties/test_privacy.py), BatchNorm averaging, the baselines'
personal layers, and the shipped configs end to end. The networks' formulas are in
``tests/models/test_perfedsi.py``, the side information in ``tests/datamodules/test_side_info.py``, the feature shift
in ``tests/datamodules/test_feature_shift.py``, the synthetic experiments in
``tests/experiments/test_side_information.py``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from datamodules import (
    DigitsShiftDataModule,
)
from fl_lightning.algorithms import FedAvg, FedPer, LGFedAvg
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import ConvNet4, PerFedSIMask
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import make_trainer


# ---- the engine with side information -------------------------------------------------------------------
def observe_uploads(module: FederatedModule, sink: list) -> None:
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: sink.append((c, {n: v.clone() for n, v in t.items()})))

    module.attach_data = attach_and_observe


def test_mask_upload_reveals_the_side_group_as_declared_and_bn_buffers_are_averaged():
    """PerFedSI's mask model uploads every parameter and BN buffer (no other name, no z), but the learned mask's
    update moves only the client's column of W: the upload reveals the side group, which the ledger records
    as side-dependent (``Mask.reveals``, ``tests/properties/test_privacy.py``)."""
    torch.manual_seed(0)
    net = PerFedSIMask(10, 4, "learned", in_channels=1, image_size=16, width=8)
    dm = DigitsShiftDataModule(num_clients=8, clients_per_round=4, seed=0)
    module = FederatedModule(FedAvg(1), net, lr=0.05, aggregation="uniform", eval_every=100, eval_last=0)
    seen: list = []
    observe_uploads(module, seen)
    before = {n: b.clone() for n, b in net.named_buffers()}
    trainer = make_trainer(1)
    trainer.fit(module, datamodule=dm)
    side = dm.federated.side
    everything = {n for n, _ in net.named_parameters()} | {n for n, _ in net.named_buffers()}
    assert len(seen) == 4 and not FedAvg().personal
    for _, upload in seen:
        assert set(upload) == everything  # PerFedSI: every parameter and BN buffer is global, nothing else
    record = module.ledger.history[-1]
    assert record.side_dependent_bytes == record.bytes > 0 and "group" in module.ledger.describe()
    # the side branch saw each client's own z: the learned mask's moved columns are the client's one-hot group
    for client, upload in seen:
        moved = (upload["side.embed.weight"] - 1).abs().sum(0) > 0
        assert moved.tolist() == side[client].bool().tolist()
    # BatchNorm statistics: the new global buffer is the unweighted mean of the uploaded local ones
    for n, b in net.named_buffers():
        assert not torch.equal(b, before[n])
        assert_close_finite(b, torch.stack([u[n] for _, u in seen]).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "algorithm,personal",
    [(FedPer(1), ["head."]), (LGFedAvg(1, personal=("body.conv1.", "body.conv2.")), ["body.conv1.", "body.conv2."])],
)
def test_baselines_keep_their_personal_layers_and_bn_on_the_client(algorithm, personal):
    net = ConvNet4(10, in_channels=1, image_size=16, width=8)
    module = FederatedModule(algorithm, net, lr=0.05, eval_every=100, eval_last=0)
    seen: list = []
    observe_uploads(module, seen)
    make_trainer(1).fit(module, datamodule=DigitsShiftDataModule(num_clients=8, clients_per_round=2, seed=0))
    names = {n for n, _ in net.named_parameters()} | {n for n, _ in net.named_buffers()}
    mine = {n for n in names if any(n.startswith(p) for p in personal)}
    assert mine and all(set(upload) == names - mine for _, upload in seen)
    if "body.conv1." in personal:  # SR/PR split includes the blocks' BatchNorm statistics
        assert "body.conv1.bn.running_mean" in module.bank.names


def write_cifar10(root, per_file: int = 40) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        blob = {"data": rng.integers(0, 256, (per_file, 3072), dtype=np.uint8), "labels": list(range(10)) * 4}
        (folder / name).write_bytes(pickle.dumps(blob))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))


def test_cifar_shift_config_runs_end_to_end_through_train_py(tmp_path):
    from fl_lightning.cli import run

    write_cifar10(tmp_path)
    summary = run(
        [
            "--config", "configs/perfedsi/cifar10_m100.yaml",
            "--config", "configs/perfedsi/perfedsi_mask.yaml",
            "--data.init_args.base.init_args.num_clients", "8",
            "--data.init_args.base.init_args.data_dir", str(tmp_path),
            "--model.network.init_args.width", "8",
            "--trainer.max_steps", "2",
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1


def write_omniglot(root, alphabets: int = 2, characters: int = 3, drawings: int = 20) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for a in range(alphabets):
        part = "images_background" if a % 2 == 0 else "images_evaluation"
        for c in range(characters):
            folder = root / "omniglot-py" / part / f"Alphabet_{a}" / f"character{c:02d}"
            folder.mkdir(parents=True)
            for d in range(drawings):
                pixels = (rng.random((20, 20)) > 0.2).astype(np.uint8) * 255
                Image.fromarray(pixels).save(folder / f"{c:02d}_{d:02d}.png")


def test_omniglot_concat_config_with_alphabet_embedding_runs_end_to_end(tmp_path):
    from fl_lightning.cli import run

    write_omniglot(tmp_path)
    summary = run(
        [
            "--config", "configs/perfedsi/omniglot_m50.yaml",
            "--config", "configs/perfedsi/perfedsi_concat.yaml",
            "--data.init_args.base.init_args.num_clients", "2",
            "--data.init_args.base.init_args.data_dir", str(tmp_path),
            "--data.init_args.side.init_args.epochs", "1",
            "--data.init_args.side.init_args.width", "8",
            "--model.network.init_args.width", "8",
            "--model.network.init_args.side_dim", "32",  # 8 channels · 2 · 2 for 32×32 images
            "--trainer.max_steps", "2",
            "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run"),
        ]
    )  # fmt: skip
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1
