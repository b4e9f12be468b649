"""Partitioners, partition hash and report, augmentation, and the Table 1 configs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from data_fixtures import TABLE1_COLUMNS, make_fixture, write_cifar10  # noqa: E402

from datamodules import (  # noqa: E402
    CIFAR10DataModule,
    DigitsDataModule,
    Dirichlet,
    LogNormal,
    Natural,
    PerClientSplit,
    Shards,
)
from datamodules.augment import CropFlip  # noqa: E402
from datamodules.partition_report import (  # noqa: E402
    federated_report,
    format_report,
    heatmap_figure,
    parse,
    partition_report,
    write_report,
)
from fl_lightning.engine.client_data import ClientSplit, FederatedData  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def labels(per_class: list[int], seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.permutation(np.repeat(np.arange(len(per_class)), per_class)))


def class_counts(y: torch.Tensor, sets, num_classes: int) -> np.ndarray:
    return np.stack([np.bincount(y[s].numpy(), minlength=num_classes) for s in sets])


# ---- partitioners ---------------------------------------------------------------------------------------
def test_shards_exact_classes_and_counts():
    y_tr, y_te = labels([100] * 10), labels([20] * 10, seed=1)
    tr, te = Shards(5)(y_tr, y_te, 20, np.random.default_rng(0))
    h_tr, h_te = class_counts(y_tr, tr, 10), class_counts(y_te, te, 10)
    # 20·5 = 100 shards, 10 per class of 100/10 = 10 images; test shards of 20/10 = 2 images
    assert ((h_tr > 0).sum(1) == 5).all() and set(h_tr[h_tr > 0].tolist()) == {10}
    assert ((h_te > 0) == (h_tr > 0)).all() and set(h_te[h_te > 0].tolist()) == {2}
    assert sorted(torch.cat(tr).tolist()) == list(range(1000))  # every sample used once


def test_dirichlet_tracks_alpha():
    y = labels([300] * 10)

    def mean_top_share(alpha: float) -> float:
        tr, _ = Dirichlet(alpha, min_samples=1)(y, y[:0], 10, np.random.default_rng(0))
        h = class_counts(y, tr, 10)
        return float((h.max(1) / h.sum(1)).mean())

    # near-uniform class mix at large α (10 classes → top share ≈ 0.1), one dominant class at small α
    assert mean_top_share(1000.0) < 0.15
    assert mean_top_share(0.05) > 0.5


def test_lognormal_hits_mean_and_minimum_with_consecutive_classes():
    y = labels([4000] * 10)
    part = LogNormal(classes_per_client=3, mean_samples=148, min_samples=50, test_fraction=0.1)
    tr, te = part(y, y, 150, np.random.default_rng(0))
    sizes = np.array([len(a) + len(b) for a, b in zip(tr, te)])
    assert sizes.sum() == 150 * 148 and sizes.min() == 50
    assert np.median(sizes) < sizes.mean()  # right-skewed like lognormal(4, 1)
    h = class_counts(y, [torch.cat([a, b]) for a, b in zip(tr, te)], 10)
    for i in range(150):
        assert set(np.flatnonzero(h[i])) == {(i + j) % 10 for j in range(3)}
        assert h[i].max() - h[i][h[i] > 0].min() <= 1  # split evenly over the 3 classes
    test_share = sum(len(b) for b in te) / sizes.sum()
    assert abs(test_share - 0.1) < 0.01
    all_idx = torch.cat([*tr, *te])
    assert len(set(all_idx.tolist())) == len(all_idx)  # drawn without replacement


def test_natural_min_samples_sampling_and_groups():
    # owner g has 10 + 5g training samples and 2 test samples
    g_tr = torch.cat([torch.full((10 + 5 * g,), g) for g in range(10)])
    g_te = torch.arange(10).repeat_interleave(2)
    y_tr, y_te = torch.zeros_like(g_tr), torch.zeros_like(g_te)
    tr, te = Natural(min_samples=30)(y_tr, y_te, 4, np.random.default_rng(0), g_tr, g_te)
    owners = [int(g_tr[s[0]]) for s in tr]
    assert len(set(owners)) == 4 and all(10 + 5 * g + 2 >= 30 for g in owners)
    for s, t, g in zip(tr, te, owners):  # each client is one owner, whole
        assert sorted(s.tolist()) == torch.nonzero(g_tr == g).flatten().tolist()
        assert sorted(t.tolist()) == torch.nonzero(g_te == g).flatten().tolist()
    # two clients per owner, split class by class
    y2 = torch.arange(len(g_tr)) % 2
    tr2, _ = Natural(clients_per_group=2)(y2, y_te, 20, np.random.default_rng(0), g_tr, g_te)
    for a, b in zip(tr2[0::2], tr2[1::2]):
        assert int(g_tr[a[0]]) == int(g_tr[b[0]])
        assert abs(len(a) - len(b)) <= 2 and set(y2[a].tolist()) == set(y2[b].tolist()) == {0, 1}


def test_per_client_split_ratio():
    y = labels([50] * 4)
    tr, te = PerClientSplit(Shards(2), test_fraction=0.2, stratify=True)(y, y[:0], 4, np.random.default_rng(0))
    for a, b in zip(tr, te):
        assert len(b) == round(0.2 * (len(a) + len(b)))
        assert not set(a.tolist()) & set(b.tolist())
        assert set(y[a].tolist()) == set(y[b].tolist())


# ---- hash and report ------------------------------------------------------------------------------------
def cifar_dm(root: Path, seed: int, **kw) -> CIFAR10DataModule:
    return CIFAR10DataModule(num_clients=10, partition=Shards(2), data_dir=str(root), seed=seed, **kw)


def test_same_seed_same_hash(tmp_path):
    write_cifar10(tmp_path, train_per_class=10, test_per_class=4)
    a, b, c = cifar_dm(tmp_path, 0), cifar_dm(tmp_path, 0), cifar_dm(tmp_path, 1)
    for dm in (a, b, c):
        dm.setup("fit")
    assert a.partition_hash() == b.partition_hash() != c.partition_hash()


def report_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "datamodules.partition_report", *args],
        capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=180,
    )  # fmt: skip


@pytest.mark.slow
def test_report_cli_help_and_a_digits_run_in_another_process(tmp_path):
    """``python -m datamodules.partition_report`` parses like train.py (jsonargparse: --help, the quickstart config with
    its trainer/model/wandb sections, dotted --data overrides) and prints the hash this process computes."""
    out = report_cli("--help")
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and "--data" in out.stdout and "--seed_everything" in out.stdout
    args = ["--config", "configs/quickstart.yaml", "--data.init_args.num_clients", "10",
            "--data.init_args.val_fraction", "0.25", "--seed_everything", "3"]  # fmt: skip
    out = report_cli(*args, "--out", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.2, seed=3, val_fraction=0.25)
    dm.setup("fit")
    assert f"datamodule: DigitsDataModule  seed: 3  partition hash: {dm.partition_hash()}" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == f"report: {tmp_path / 'rep' / 'partition.json'}"
    report = json.loads((tmp_path / "rep" / "partition.json").read_text())
    assert report["hash"] == dm.partition_hash() and report["num_clients"] == 10
    assert report["val_sizes"] == dm.federated.val.sizes.tolist() and report["val_samples"] > 0
    assert (tmp_path / "rep" / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = report_cli("--config", "configs/quickstart.yaml", "--data.init_args.num_clientz", "3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "num_clientz" in bad.stderr


def test_heatmap_ticks_are_integers():
    """Few classes and clients make matplotlib's default ticks fractional (0.5 …); ours stay integers."""
    import matplotlib.pyplot as plt

    y = torch.tensor([0, 1, 1, 0, 0, 1, 1])
    train = ClientSplit.from_indices(torch.zeros(7, 2), y, [torch.tensor(r) for r in ([0, 1], [2, 3, 4], [5, 6])])
    fed = FederatedData(train, train, num_classes=2)
    report = {"datamodule": "Tiny", **federated_report(fed)}
    fig = heatmap_figure(report)
    ax, bar_ax = fig.axes
    for ticks, (lo, hi) in ((ax.get_xticks(), ax.get_xlim()), (ax.get_yticks(), sorted(ax.get_ylim()))):
        shown = [t for t in ticks if lo <= t <= hi]
        assert shown and all(float(t).is_integer() for t in shown), ticks
    counts = [t for t in bar_ax.get_yticks() if 1 <= t <= 2]
    assert counts and all(float(t).is_integer() for t in counts)
    plt.close(fig)


def test_report_counts_and_histograms(tmp_path):
    write_cifar10(tmp_path, train_per_class=10, test_per_class=4)
    dm = cifar_dm(tmp_path, 0, holdout_clients=5)
    dm.setup("fit")
    rep = partition_report(dm)
    y = dm.federated.train.y
    assert rep["train_sizes"] == dm.federated.train.sizes.tolist()
    for c in range(10):
        ref = np.bincount(dm.federated.train.client(c)[1].numpy(), minlength=10).tolist()
        assert rep["train_histogram"][c] == ref
    assert sum(map(sum, rep["train_histogram"])) == len(y) == sum(rep["train_sizes"])
    assert rep["train_samples"] + rep["new_clients"]["train_samples"] == 100  # 15 clients share 10 × 10 images
    assert rep["classes_per_client"] == {"mean": 2.0, "min": 2, "max": 2}
    assert rep["test_classes_outside_train"] == 0
    assert rep["new_clients"]["num_clients"] == 5
    text = format_report(rep)
    assert rep["hash"] in text and "new clients" in text
    paths = write_report(dm, tmp_path / "out")
    assert paths["png"].exists() and json.loads(paths["json"].read_text())["hash"] == rep["hash"]


# ---- augmentation ---------------------------------------------------------------------------------------
def test_crop_flip_matches_a_padded_crop():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    x = torch.randn(16, 3, 8, 8)
    aug = CropFlip(2, True, mean, std)
    out = aug(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, aug(x, torch.Generator().manual_seed(0)))
    fill = torch.tensor([-m / s for m, s in zip(mean, std)]).view(3, 1, 1)
    flips = 0
    for i in range(16):
        padded = fill.expand(3, 12, 12).clone()
        padded[:, 2:10, 2:10] = x[i]
        crops = [padded[:, r : r + 8, c : c + 8] for r in range(5) for c in range(5)]
        plain = any(torch.allclose(out[i], cr) for cr in crops)
        flipped = any(torch.allclose(out[i], cr.flip(-1)) for cr in crops)
        assert plain or flipped
        flips += flipped and not plain
    assert 0 < flips < 16


# ---- Table 1 configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("column", TABLE1_COLUMNS)
def test_table1_config_builds_on_fixture(tmp_path, column):
    config = ROOT / "configs" / "table1" / f"{column}.yaml"
    full = yaml.safe_load(config.read_text())
    assert "algorithm" not in full["model"] and full["model"]["lr"] == 0.01 and full["model"]["momentum"] == 0.5
    args = ["--config", str(config), *make_fixture(column, tmp_path)]
    dm, _, _ = parse(args)  # the same YAML and overrides as train.py; non-data keys are ignored
    dm.setup("fit")
    rep = partition_report(dm)
    part = full["data"]["init_args"]["partition"]
    if part["class_path"].endswith("Shards"):
        s = part["init_args"]["classes_per_client"]
        assert rep["classes_per_client"] == {"mean": float(s), "min": s, "max": s}
    if part["class_path"].endswith("LogNormal"):
        sizes = np.array(rep["train_sizes"]) + np.array(rep["test_sizes"])
        assert sizes.mean() == 14 and sizes.min() >= 6 and rep["num_classes"] == 10


@pytest.mark.parametrize("column", ["cifar10_100x2", "sent140_183x2"])
def test_fedrep_end_to_end_through_train(tmp_path, column):
    from fl_lightning.cli import run

    method = tmp_path / "fedrep.yaml"
    algorithm = {"class_path": "fl_lightning.algorithms.FedRep", "init_args": {"head_epochs": 2, "body_epochs": 1}}
    method.write_text(yaml.safe_dump({"model": {"algorithm": algorithm}}))
    run_dir = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "table1" / f"{column}.yaml"), "--config", str(method),
            *make_fixture(column, tmp_path), "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--run_dir", str(run_dir)]  # fmt: skip
    summary = run(args)
    assert summary["algorithm"] == "FedRep" and summary["rounds"] == 2 and 0 <= summary["final"] <= 1
    report = json.loads((run_dir / "partition" / "partition.json").read_text())
    assert (run_dir / "partition" / "partition.png").exists()
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["partition/hash"] == report["hash"]


@pytest.mark.slow
def test_missing_data_is_one_line_error_through_train(tmp_path):
    method = tmp_path / "fedrep.yaml"
    method.write_text("model:\n  algorithm:\n    class_path: fl_lightning.algorithms.FedRep\n")
    out = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/table1/cifar100_100x5.yaml", "--config", str(method),
         "--data.init_args.data_dir", str(tmp_path / "absent"), "--run_dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert "cifar-100-python" in errors[0] and "download: true" in errors[0]
