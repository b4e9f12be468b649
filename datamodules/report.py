"""Partition report: hash, per-client sample counts, class histograms and a clients × classes heat-map.

Written to ``<run dir>/partition/{partition.json, partition.png}`` and logged when a run starts. Without
training::

    python -m datamodules.report --config configs/table1/cifar10_100x2.yaml [--config ...] [--data.* ...] \
        [--out DIR]

reads the same YAML as ``train.py`` (only ``data`` and ``seed_everything`` are used; the rest is ignored),
builds the partition, prints the report and writes the files (default ``runs/<config names>/partition``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from datamodules.base import FederatedDataModule
from fl_lightning.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError


def _histogram(split: ClientSplit, num_classes: int) -> np.ndarray:
    """``[clients, classes]`` sample counts."""
    owner = split.client_ids().cpu()
    flat = owner * num_classes + split.y.cpu().long()
    return torch.bincount(flat, minlength=split.num_clients * num_classes).view(-1, num_classes).numpy()


def federated_report(fed: FederatedData) -> dict[str, Any]:
    """Counts and histograms of one federation (plus its partition hash)."""
    tr, te = fed.train.sizes.cpu().numpy(), fed.test.sizes.cpu().numpy()
    out: dict[str, Any] = {
        "hash": FederatedDataModule.partition_hash(SimpleNamespace(federated=fed)),
        "num_clients": fed.num_clients,
        "num_classes": fed.num_classes,
        "train_samples": int(tr.sum()),
        "test_samples": int(te.sum()),
        "train_size": {"mean": float(tr.mean()), "min": int(tr.min()), "max": int(tr.max()), "std": float(tr.std())},
        "test_size": {"mean": float(te.mean()), "min": int(te.min()), "max": int(te.max())},
        "train_sizes": tr.tolist(),
        "test_sizes": te.tolist(),
    }
    if fed.num_classes is not None:
        h_tr, h_te = _histogram(fed.train, fed.num_classes), _histogram(fed.test, fed.num_classes)
        per_client = (h_tr > 0).sum(1)
        out["classes_per_client"] = {
            "mean": float(per_client.mean()),
            "min": int(per_client.min()),
            "max": int(per_client.max()),
        }
        out["test_classes_outside_train"] = int(((h_te > 0) & (h_tr == 0)).sum())
        out["train_histogram"], out["test_histogram"] = h_tr.tolist(), h_te.tolist()
    return out


def partition_report(dm: FederatedDataModule) -> dict[str, Any]:
    """The report of a set-up data module (``dm.federated`` and, if any, ``dm.new_clients``)."""
    if dm.federated is None:
        dm.setup("fit")
    report = {"datamodule": type(dm).__name__, "seed": dm.resolved_seed, **federated_report(dm.federated)}
    report["hash"] = dm.partition_hash()
    new = getattr(dm, "new_clients", None)
    if new is not None:
        report["new_clients"] = federated_report(new)
    return report


def format_report(report: dict[str, Any], max_rows: int = 20) -> str:
    """A readable summary: totals, size statistics and the first ``max_rows`` clients."""
    lines = [
        f"datamodule: {report['datamodule']}  seed: {report['seed']}  partition hash: {report['hash']}",
    ]

    def block(r: dict[str, Any], title: str) -> None:
        s, t = r["train_size"], r["test_size"]
        lines.append(
            f"{title}: {r['num_clients']} clients, {r['train_samples']} train / {r['test_samples']} test samples, "
            f"{r['num_classes']} classes"
        )
        lines.append(
            f"  train per client: mean {s['mean']:.1f}, min {s['min']}, max {s['max']}, std {s['std']:.1f}; "
            f"test per client: mean {t['mean']:.1f}, min {t['min']}, max {t['max']}"
        )
        if "classes_per_client" in r:
            c = r["classes_per_client"]
            lines.append(
                f"  classes per client: mean {c['mean']:.2f}, min {c['min']}, max {c['max']}; "
                f"test samples of classes a client has no training data for: {r['test_classes_outside_train']}"
            )
            lines.append("  client  train  test  classes (train counts)")
            for i in range(min(max_rows, r["num_clients"])):
                row = r["train_histogram"][i]
                cls = ", ".join(f"{k}:{v}" for k, v in enumerate(row) if v)
                cls = cls if len(cls) <= 70 else cls[:67] + "..."
                lines.append(f"  {i:6d}  {r['train_sizes'][i]:5d}  {r['test_sizes'][i]:4d}  {cls}")
            if r["num_clients"] > max_rows:
                lines.append(f"  ... ({r['num_clients'] - max_rows} more clients in partition.json)")

    block(report, "federation")
    if "new_clients" in report:
        block(report["new_clients"], f"new clients (hash {report['new_clients']['hash']})")
    return "\n".join(lines)


def heatmap(report: dict[str, Any], path: Path) -> Path | None:
    """PNG heat-map of training samples per client (rows) and class (columns)."""
    if "train_histogram" not in report:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = np.asarray(report["train_histogram"])
    fig, ax = plt.subplots(figsize=(min(12, 5 + 0.25 * h.shape[1]), min(10, 3 + 0.08 * h.shape[0])))
    im = ax.imshow(h, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"{report['datamodule']} (hash {report['hash']})\ntraining samples per client and class", fontsize=9)
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(dm: FederatedDataModule, out_dir: Path) -> dict[str, Path]:
    """Write ``partition.json`` and ``partition.png`` into ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = partition_report(dm)
    paths = {"json": out_dir / "partition.json"}
    paths["json"].write_text(json.dumps(report))
    png = heatmap(report, out_dir / "partition.png")
    if png is not None:
        paths["png"] = png
    return paths


def log_report(dm: FederatedDataModule, loggers: list[Any], paths: dict[str, Path]) -> None:
    """Log the hash and size statistics as hyper-parameters, and the heat-map to W&B."""
    report = partition_report(dm)
    flat = {
        "partition/hash": report["hash"],
        "partition/train_size_mean": report["train_size"]["mean"],
        "partition/train_size_min": report["train_size"]["min"],
        "partition/train_size_max": report["train_size"]["max"],
        "partition/report": str(paths["json"]),
    }
    if "classes_per_client" in report:
        flat["partition/classes_per_client_mean"] = report["classes_per_client"]["mean"]
    if "new_clients" in report:
        flat["partition/new_clients_hash"] = report["new_clients"]["hash"]
    for logger in loggers:
        logger.log_hyperparams(flat)
        if "png" in paths and hasattr(logger, "log_image"):
            try:
                logger.log_image(key="partition/heatmap", images=[str(paths["png"])])
            except Exception:  # a logger without image support must not stop training
                pass


# ---- command line --------------------------------------------------------------------------------------
def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and not ("class_path" in v and v.get("class_path") != out[k].get("class_path"))
        ):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def parse(argv: list[str]) -> tuple[FederatedDataModule, Path | None, list[str]]:
    """``--config`` files (merged in order like LightningCLI), ``--data.*`` and ``--seed_everything``
    overrides, ``--out``. Returns the (not yet set-up) data module, the output folder and the configs."""
    import yaml
    from jsonargparse import ArgumentParser

    configs, overrides, out, seed, i = [], [], None, None, 0
    merged: dict[str, Any] = {}
    while i < len(argv):
        arg = argv[i]
        key, _, value = arg.partition("=")
        if not _:
            value = argv[i + 1] if i + 1 < len(argv) else ""
            i += 1
        i += 1
        if key == "--config":
            path = Path(value)
            if not path.exists():
                raise ConfigError(f"--config: file {path} does not exist")
            merged = _merge(merged, yaml.safe_load(path.read_text()) or {})
            configs.append(value)
        elif key == "--out":
            out = Path(value)
        elif key == "--seed_everything":
            seed = value
        elif key.startswith("--data"):
            overrides += [key, value]
        elif not key.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}")
    if "data" not in merged and not overrides:
        raise ConfigError("no data section: give --config with a data: block")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(FederatedDataModule, "data", required=True)
    try:
        cfg = parser.parse_args(["--data", json.dumps(merged.get("data", {})), *overrides])
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        dm = instantiate(cfg).data
    except Exception as exc:
        from fl_lightning.cli import _one_line

        raise ConfigError(_one_line(exc)) from None
    seed = seed if seed is not None else merged.get("seed_everything")
    if seed is not None and str(seed).lstrip("-").isdigit():
        os.environ["PL_GLOBAL_SEED"] = str(int(seed))  # what LightningCLI's seed_everything sets
    return dm, out, configs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        dm, out, configs = parse(argv)
        dm.setup("fit")
        report = partition_report(dm)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = out or Path("runs") / ("_".join(Path(c).stem for c in configs) or "run") / "partition"
    paths = write_report(dm, out)
    print(format_report(report))
    print(f"report: {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
