"""Partition report: hash, per-client sample counts, class histograms and a clients × classes heat-map.

Written to ``<run dir>/partition/{partition.json, partition.png}`` and logged when a run starts. Without
training::

    python -m datamodules.partition_report --config configs/table1/cifar10_100x2.yaml [--config ...] \
        [--data.init_args.num_clients 20 ...] [--seed_everything 1] [--out DIR]

The parser is jsonargparse, as in ``train.py``: the same YAML files (only ``data`` and ``seed_everything``
are used; ``trainer``, ``model`` and the other train.py sections and their dotted overrides are accepted
and ignored), the same dotted ``--data.*`` overrides, ``--help`` and ``--print_config``. It builds the
partition, prints the report and writes the files (default ``runs/<config names>/partition``).
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
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError

#: train.py's top-level sections that a report ignores (accepted so that the same config files parse).
IGNORED_SECTIONS = (
    "trainer", "model", "optimizer", "lr_scheduler", "wandb", "run_dir", "ckpt_path", "checkpoint_every",
)  # fmt: skip


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
    if fed.val is not None:
        va = fed.val.sizes.cpu().numpy()
        out["val_samples"], out["val_sizes"] = int(va.sum()), va.tolist()
        out["val_size"] = {"mean": float(va.mean()), "min": int(va.min()), "max": int(va.max())}
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
        if fed.val is not None:
            out["val_histogram"] = _histogram(fed.val, fed.num_classes).tolist()
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
        if "val_size" in r:
            v = r["val_size"]
            lines.append(
                f"  validation (carved from training): {r['val_samples']} samples, per client mean {v['mean']:.1f}, "
                f"min {v['min']}, max {v['max']}"
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


def heatmap_figure(report: dict[str, Any]):
    """The matplotlib figure of training samples per client (rows) and class (columns); every tick (class,
    client, sample count) is an integer. ``None`` for regression data (no classes)."""
    if "train_histogram" not in report:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    h = np.asarray(report["train_histogram"])
    fig, ax = plt.subplots(figsize=(min(12, 5 + 0.25 * h.shape[1]), min(10, 3 + 0.08 * h.shape[0])))
    im = ax.imshow(h, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{report['datamodule']} (hash {report['hash']})\ntraining samples per client and class", fontsize=9)
    bar = fig.colorbar(im, ax=ax, label="samples")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    fig.tight_layout()
    return fig


def heatmap(report: dict[str, Any], path: Path) -> Path | None:
    """Save :func:`heatmap_figure` as a PNG at ``path``."""
    fig = heatmap_figure(report)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

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
    if "val_samples" in report:
        flat["partition/val_samples"] = report["val_samples"]
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
def build_parser():
    """A jsonargparse parser reading train.py's config files: ``data`` as LightningCLI reads it."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(
        prog="python -m datamodules.partition_report",
        description="Build a config's client partition and report it: hash, per-client counts, class histograms "
        "and a clients × classes heat-map. Takes the same --config files and --data.* overrides as train.py.",
        exit_on_error=False,
    )
    parser.add_argument("--config", action=ActionConfigFile, help="A train.py YAML file (repeatable, merged in order).")
    parser.add_argument(
        "--seed_everything", type=int | bool | None, default=None,
        help="The run's seed (sets the partition seed unless data sets its own); true/absent: the data's seed or 0.",
    )  # fmt: skip
    parser.add_subclass_arguments(FederatedDataModule, "data", required=True, help="The DataModule, as in train.py.")
    parser.add_argument("--out", type=str | None, default=None, help="Output folder (default runs/<configs>/partition)")
    for key in IGNORED_SECTIONS:
        parser.add_argument(f"--{key}", type=Any, default=None, help="train.py's; ignored here.")
    return parser


def drop_ignored_overrides(argv: list[str]) -> list[str]:
    """train.py's dotted overrides of ignored sections (``--model.lr 0.1``, ``--trainer.max_steps=5``) removed,
    so that a report takes a train.py command line as it is."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and arg[2:].split("=", 1)[0].split(".", 1)[0] in IGNORED_SECTIONS and "." in arg:
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out


def parse(argv: list[str]) -> tuple[FederatedDataModule, Path | None, list[str]]:
    """Returns the (not yet set-up) data module, the output folder and the config files given."""
    from jsonargparse import ArgumentError

    from fl_lightning.errors import check_config_files, one_line

    check_config_files(argv)
    parser = build_parser()
    try:
        cfg = parser.parse_args(drop_ignored_overrides(argv))
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        dm = instantiate(cfg).data
    except (ArgumentError, TypeError, ValueError) as exc:
        raise ConfigError(one_line(exc)) from None
    seed = cfg.seed_everything
    if isinstance(seed, int) and not isinstance(seed, bool):
        os.environ["PL_GLOBAL_SEED"] = str(seed)  # what LightningCLI's seed_everything sets
    configs = [str(c) for c in (cfg.get("config") or [])]
    return dm, None if cfg.out is None else Path(cfg.out), configs


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
