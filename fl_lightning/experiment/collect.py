"""Finished runs as plain records, read from run dirs or from W&B (the public API).

A run dir gives ``summary.json`` (the run summary), ``metrics.csv`` (the curves), ``clients.csv`` (the final
per-client accuracy and loss, when the run wrote it) and, when the experiment runner made it, ``run.json`` (the
experiment, the axis labels and the command). A run dir of a plain ``train.py`` run has no ``run.json``: its
method is the algorithm of its summary, its seed ``seed_everything`` of its ``config.yaml``.

A W&B run gives the same: the axis labels from its tags (``axis:label``, as the runner sets them), the summary
from ``summary/<key>`` in its run summary, the curves from its history.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError

#: where a run's summary goes in ``wandb.summary`` (``summary/last10``, ...), next to the last logged metrics
WANDB_SUMMARY_PREFIX = "summary/"


@dataclass
class RunResult:
    """One finished run: who it is (experiment, axis labels, seed) and what it measured."""

    experiment: str
    axes: dict[str, str]
    seed: int | None
    summary: dict[str, Any]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    clients: list[dict[str, float]] | None = None
    source: str = ""

    def key(self, by: Iterable[str]) -> tuple[str, ...]:
        return tuple(self.label(b) for b in by)

    def label(self, axis: str) -> str:
        if axis == "experiment":
            return self.experiment
        if axis == "seed":
            return "-" if self.seed is None else str(self.seed)
        return self.axes.get(axis, "-")

    @property
    def metric(self) -> str:
        """What the run's accuracy-like figures are: ``acc`` or ``mse`` (``summary['metric']``)."""
        return str(self.summary.get("metric", "acc"))


# ---- run dirs -----------------------------------------------------------------------------------------------------


def read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every ``val/*``, ``train/*`` and ``comm/*`` column of a Lightning ``metrics.csv`` as ``(step, value)``
    points (one per step: the last value logged at that step)."""
    if not path.is_file():
        return {}
    points: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for k, v in row.items():
                if k in ("step", "epoch") or v in (None, "") or "/" not in k:
                    continue
                try:
                    points.setdefault(k, {})[int(float(step))] = float(v)
                except ValueError:
                    continue
    return {k: sorted(v.items()) for k, v in points.items()}


def read_clients(path: Path) -> list[dict[str, float]] | None:
    if not path.is_file():
        return None
    with path.open(newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in (None, "")} for row in csv.DictReader(f)]


def _config_seed(run_dir: Path) -> int | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    import yaml

    try:
        seed = (yaml.safe_load(path.read_text()) or {}).get("seed_everything")
    except yaml.YAMLError:
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file()


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """The run dirs in ``paths``: a path that holds ``summary.json`` is one, a folder is searched below."""
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"{p} does not exist")
        if is_run_dir(p):
            out.append(p)
        else:
            found = sorted(s.parent for s in p.rglob("summary.json") if "wandb" not in s.parts)
            if not found:
                raise ConfigError(f"{p}: no finished run below it (no summary.json)")
            out += found
    seen: set[Path] = set()
    return [p for p in out if not (p.resolve() in seen or seen.add(p.resolve()))]


def load_run_dir(run_dir: Path) -> RunResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    meta = {}
    if (run_dir / "run.json").is_file():
        meta = json.loads((run_dir / "run.json").read_text())
    axes = {k: str(v) for k, v in meta.get("axes", {}).items()}
    seed = meta.get("seed")
    if seed is None:
        seed = _config_seed(run_dir)
    if "method" not in axes and meta.get("job_type"):
        axes["method"] = meta["job_type"]
    axes.setdefault("method", str(summary.get("algorithm", run_dir.name)))
    if seed is not None:
        axes.setdefault("seed", f"s{seed}")
    return RunResult(
        experiment=meta.get("experiment", run_dir.parent.name),
        axes=axes,
        seed=seed,
        summary=summary,
        curves=read_curves(run_dir / "metrics.csv"),
        clients=read_clients(run_dir / "clients.csv"),
        source=str(run_dir),
    )


def from_run_dirs(paths: Iterable[str | Path]) -> list[RunResult]:
    return [load_run_dir(p) for p in find_run_dirs(paths)]


# ---- W&B ----------------------------------------------------------------------------------------------------------


def from_wandb(
    project: str, group: str, api: Any = None, curve_keys: Iterable[str] = ("val/acc_mean",)
) -> list[RunResult]:
    """The finished runs of W&B group ``group`` in ``project`` (``entity/project`` or ``project``), through
    ``wandb.Api`` (or any object with its ``runs(path, filters=...)``)."""
    if api is None:
        import wandb

        api = wandb.Api()
    out = []
    for run in api.runs(project, filters={"group": group}):
        if getattr(run, "state", "finished") != "finished":
            continue
        summary_raw = dict(run.summary)
        summary = {
            k[len(WANDB_SUMMARY_PREFIX) :]: v for k, v in summary_raw.items() if k.startswith(WANDB_SUMMARY_PREFIX)
        }
        if not summary:
            continue  # not a run of this framework, or it never reached its end
        axes: dict[str, str] = {}
        seed = None
        for tag in run.tags or []:
            if ":" in tag:
                axis, label = tag.split(":", 1)
                if axis == "seed":
                    seed = int(label) if label.lstrip("-").isdigit() else None
                    axes["seed"] = f"s{label}"
                elif "." in axis:
                    axes[axis] = f"{axis.rsplit('.', 1)[1]}={label}"
                else:
                    axes[axis] = label
        config = dict(run.config or {})
        if seed is None and isinstance(config.get("seed_everything"), int):
            seed = config["seed_everything"]
        if "method" not in axes:
            axes["method"] = run.job_type or str(summary.get("algorithm", run.name))
        curves: dict[str, list[tuple[int, float]]] = {}
        keys = [k for k in curve_keys]
        if keys:
            points: dict[str, dict[int, float]] = {}
            for row in run.scan_history(keys=["trainer/global_step", *keys]):
                step = row.get("trainer/global_step")
                for k in keys:
                    v = row.get(k)
                    if step is not None and isinstance(v, (int, float)) and not math.isnan(v):
                        points.setdefault(k, {})[int(step)] = float(v)
            curves = {k: sorted(v.items()) for k, v in points.items()}
        out.append(
            RunResult(
                experiment=getattr(run, "group", None) or group,
                axes=axes,
                seed=seed,
                summary=summary,
                curves=curves,
                clients=None,
                source=f"wandb:{project}/{getattr(run, 'id', run.name)}",
            )
        )
    if not out:
        raise ConfigError(f"W&B {project}: no finished fl_lightning run in group {group!r}")
    return out
