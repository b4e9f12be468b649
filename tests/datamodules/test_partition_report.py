"""Partitioners, partition hash and report, augmentation, and the Table 1 configs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from datamodules import DigitsDataModule, Shards
from datamodules.partition_report import federated_report, format_report, heatmap_figure, partition_report, write_report
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from tests.helpers.cifar_data import ROOT, cifar_dm
from tests.helpers.data_fixtures import write_cifar10


def report_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "datamodules.partition_report", *args],
        capture_output=True, text=True, cwd=ROOT, env=env,
        timeout=180,
    )  # fmt: skip


@pytest.mark.slow
def test_report_cli_help_and_a_digits_run_in_another_process(tmp_path, capsys, monkeypatch):
    """``python -m datamodules.partition_report`` parses like train.py (jsonargparse: --help, the quickstart config with
    its trainer/model/wandb sections, dotted --data overrides) and prints the hash this process computes. The run is
    another process; --help and the refused override go through the same ``main`` in this one (no interpreter start
    each)."""
    from datamodules.partition_report import main as report_main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stop:
        report_main(["--help"])
    help_out = capsys.readouterr().out
    assert stop.value.code == 0
    assert "--config" in help_out and "--data" in help_out and "--seed_everything" in help_out
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
    capsys.readouterr()
    code = report_main(["--config", "configs/quickstart.yaml", "--data.init_args.num_clientz", "3"])
    bad = capsys.readouterr().err
    assert code == 2 and bad.count("\n") == 1 and "num_clientz" in bad


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
