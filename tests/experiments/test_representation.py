"""``experiments/representation.py``: the linear configs through train.py, the CIFAR-100 transfer experiment on tiny
fixture files, and ``--quick``'s records and plots. The batched math of ``experiments/linear_representation/`` is
tested in ``tests/experiments/linear_representation/``."""

from __future__ import annotations

import json
import pickle

import numpy as np


def test_linear_configs_run_through_train_py(tmp_path):
    from experiments.representation import CONFIGS
    from fl_lightning.cli import train_config

    overrides = ["--trainer.max_steps=3", "--trainer.enable_checkpointing=false", "--data.init_args.num_clients=4"]
    for pair in (("linear_base", "linear_fedavg"), ("fedrep_base", "gdgd")):
        summary = train_config([CONFIGS / f"{c}.yaml" for c in pair], overrides, run_dir=tmp_path / pair[1])
        assert summary["rounds"] == 3 and 0 <= summary["dist_B"] <= 1


def write_cifar100(root, per_class_train: int = 5, per_class_test: int = 5) -> None:
    """Tiny CIFAR-100 in the published python-pickle format."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, per in (("train", per_class_train), ("test", per_class_test)):
        labels = np.repeat(np.arange(100), per)
        data = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
        data[:, :100] = (labels * 2)[:, None]  # a class-dependent patch so fine-tuning has signal
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "fine_labels": labels.tolist(), "coarse_labels": [0] * len(labels)}, f)
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"class{i}" for i in range(100)]}))


def test_cifar100_transfer_configs_dry_run(tmp_path):
    from experiments.representation import cifar_transfer

    write_cifar100(tmp_path / "data")
    overrides = [
        f"--data.init_args.data_dir={tmp_path / 'data'}",
        "--data.init_args.num_clients=16",
        "--trainer.max_steps=2",
        "--trainer.accelerator=cpu",
        "--model.algorithm.init_args.local_steps=2",
        "--model.eval_last=1",
        "--model.new_client_finetune.epochs=1",
        "--model.network.init_args.channels=[4,4,4,4,4,4]",
        "--model.network.init_args.hidden=16",
    ]
    records = cifar_transfer(tmp_path / "data", tmp_path / "out", overrides, finetune_epochs=1, finetune_samples=50)
    for metric in ("new_client_acc", "engine_new_clients_acc"):
        acc = {r["method"]: r["value"] for r in records if r["metric"] == metric}
        assert set(acc) == {"FedAvg τ=50", "D-SGD τ=1"} and all(0 <= v <= 1 for v in acc.values())
    sims = [r["value"] for r in records if r["metric"] == "feature_abs_cos"]
    assert len(sims) == 2 and all(0 <= v <= 1 for v in sims)


def test_reproduce_quick(tmp_path):
    from experiments.representation import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["experiment"] for r in records} >= {"spec004_fig1", "fedrep_fig3", "fedrep_fig4", "engine_spec004"}
    assert len(list(tmp_path.glob("*.png"))) >= 8
