"""Experiment files: a YAML grid of ``train.py`` runs, expanded into one :class:`RunSpec` per point.

Schema (every key but ``name`` is optional)::

    name: table1-digits              # the W&B group and the folder <runs_dir>/<name>/
    description: free text
    configs: [configs/digits/base.yaml]          # composed first by every run
    axes:                            # the runs are the product of the axes, in this order
      method:                        # a named axis: label -> config file(s) and/or dotted overrides
        fedavg: {config: configs/methods/fedavg.yaml}
        fedrep: {config: [configs/methods/fedrep.yaml], model.lr: 0.05}
        plain: null                  # nothing added
      model.momentum: [0.0, 0.5]     # a dotted-key axis: one run per value (label "momentum=0.5")
      seed: [0, 1, 2]                # sets seed_everything (label "s0")
    set: {trainer.max_steps: 100}    # dotted overrides for every run
    wandb: {project: fl_lightning, mode: auto, tags: [extra]}
    job_type: method                 # the axis whose label is the W&B job_type (default: "method" if present)
    runs_dir: runs                   # default runs/
    report: {metrics: [last10], by: [method], curve: val/acc_mean}
    tune: {metric: last10, seeds: [100, 101], val_fraction: 0.2, budget: equal, extend: 2}   # defaults of every tune

A method may say how to choose its hyper-parameters (the fair comparison protocol of issue 31)::

    axes:
      method:
        fedprox:
          config: configs/digits/fedprox.yaml
          tune: {grid: {model.lr: [0.01, 0.05], model.algorithm.init_args.mu: [0.01, 0.1]}}

``tune`` (per method; a top-level ``tune`` gives the defaults, the method's own keys win):

- ``grid``: dotted key -> list of values; the points are their product (label ``lr=0.01+mu=0.1``).
- ``seeds``: the tuning seeds (default [100, 101]); they may not be seeds of the ``seed`` axis, so the final runs
  use fresh seeds.
- ``metric``: the ``summary.json`` figure that chooses (default ``last10``: the mean client accuracy of the last
  10 rounds; ``final_ft`` for a "+FT" method). In a tuning run every per-round and end-of-run evaluation reads the
  validation split, so this is a validation figure; ``last10`` rather than ``final`` because one round's value
  is noisy. ``mode``: ``max`` (default) or ``min`` (losses, MSE).
- ``val_fraction``: the fraction of every client's training rows held out as its validation split in the tuning
  runs (``data.init_args.val_fraction``, default 0.2). The final runs train on all training rows and report the
  test split.
- ``budget`` (top level only): ``equal`` (default) refuses a file whose tuned methods get different numbers of
  trials (grid points × tuning seeds; a method with no ``tune`` has 0); ``free`` allows it (the report still shows
  every method's trials).
- ``extend`` (top level only, so every method gets the same rule; default 0: off): when a method's winner sits at
  the lower or upper edge of a numeric grid axis, the tuner adds the next value outward on that axis (at the
  winner's values of the other axes), runs it with the tuning seeds and chooses again, at most ``extend`` times
  per method, until every numeric axis of the winner is interior or a bound stops it
  (``fl_lightning/experiment/tuning.py``). A winner left on an edge is flagged in ``tune.json`` and in the table's
  "chosen" column with what stopped it.
- ``scale``: dotted key -> ``log`` or ``linear``, the axis's own scale for ``extend`` (default: ``log`` for an
  all-positive learning-rate axis, a key ending in ``lr``, or a grid of ≥ 3 positive values in constant ratio; else
  ``linear``). ``bounds``: dotted key -> ``[low, high]`` (``null``: open), the values ``extend`` may reach (default:
  ``[0, null]`` for an axis of non-negative values, ``[1, null]`` for one of positive integers).

Each point runs once per tuning seed in ``<runs_dir>/<name>/tune/<labels>/<point>/s<seed>``; the chosen point is
the one with the best mean of ``metric`` over the tuning seeds (ties: the first in grid order), then the method's
runs of the grid get its overrides (after the method's own, before the command line's ``--set``).

Arguments of one run, in order (later ones win): ``--config`` for the ``configs``, then every axis' config
files; ``set``; every axis' overrides; the seed; the command line's ``--set``; then the run dir and the W&B
settings. Relative config paths are taken from the working directory, else from the nearest folder above the
experiment file that holds them (so the repository's files work from anywhere).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError, load_yaml

TOP_KEYS = (
    "name", "description", "configs", "axes", "set", "wandb", "job_type", "runs_dir", "report", "batch_runs", "tune",
)  # fmt: skip
TUNE_KEYS = ("grid", "seeds", "metric", "mode", "val_fraction", "scale", "bounds")
TUNE_DEFAULTS: dict[str, Any] = {"seeds": [100, 101], "metric": "last10", "mode": "max", "val_fraction": 0.2}
WANDB_KEYS = ("project", "mode", "tags")
REPORT_KEYS = ("metrics", "by", "curve")
LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class ExperimentError(ConfigError):
    """A problem in an experiment file (printed as one line, exit code 2)."""


def arg_value(value: Any) -> str:
    """A YAML value as jsonargparse reads it on the command line (``--key=value``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def override(key: str, value: Any) -> str:
    return f"--{key}={arg_value(value)}"


@dataclass(frozen=True)
class AxisValue:
    """One value of one axis: its label (folder and W&B name part), its W&B tag and what it adds."""

    axis: str
    label: str
    tag: str
    configs: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    value: Any = None
    tune: Tune | None = None


@dataclass(frozen=True)
class Tune:
    """How one method's hyper-parameters are chosen: its grid, tuning seeds, metric and validation fraction."""

    grid: tuple[tuple[str, tuple[Any, ...]], ...]
    seeds: tuple[int, ...]
    metric: str = "last10"
    mode: str = "max"
    val_fraction: float = 0.2
    #: the most grid extensions when the winner sits on an edge (``extend``; 0: off)
    extend: int = 0
    #: dotted key -> "log" or "linear" (``scale``), dotted key -> (low, high) with None for open (``bounds``)
    scale: tuple[tuple[str, str], ...] = ()
    bounds: tuple[tuple[str, tuple[float | None, float | None]], ...] = ()
    #: points added by the extension (one value per grid key, in grid order), after the grid's product
    extra: tuple[tuple[Any, ...], ...] = ()

    def points(self) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
        """The grid's points in order, then the extension's: (label, overrides, {key: value})."""
        keys = [k for k, _ in self.grid]
        out, seen = [], set()
        for values in [*itertools.product(*(v for _, v in self.grid)), *self.extra]:
            label = "+".join(f"{k.rsplit('.', 1)[-1]}={arg_value(v)}" for k, v in zip(keys, values))
            if label not in seen:
                seen.add(label)
                out.append((label, tuple(override(k, v) for k, v in zip(keys, values)), dict(zip(keys, values))))
        return out

    @property
    def trials(self) -> int:
        return len(self.points()) * len(self.seeds)


@dataclass
class TuneRun:
    """One tuning run: the labels of the grid point it serves (every axis but the seed), its grid point, the run."""

    key: tuple[str, ...]
    point: str
    values: dict[str, Any]
    run: RunSpec


@dataclass
class RunSpec:
    """One point of the grid: a ``train.py`` argument list and where it writes."""

    experiment: str
    points: tuple[AxisValue, ...]
    configs: list[str]
    overrides: list[str]
    run_dir: Path
    wandb_name: str
    job_type: str | None
    tags: list[str]
    wandb: dict[str, Any] = field(default_factory=dict)

    @property
    def labels(self) -> dict[str, str]:
        return {p.axis: p.label for p in self.points}

    @property
    def seed(self) -> int | None:
        return next((p.value for p in self.points if p.axis == "seed"), None)

    def args(self) -> list[str]:
        """``train.py``'s argument list for this run."""
        out: list[str] = []
        for c in self.configs:
            out += ["--config", c]
        out += self.overrides
        out += ["--run_dir", str(self.run_dir)]
        out.append(override("wandb.group", self.experiment))
        out.append(override("wandb.name", self.wandb_name))
        if self.job_type:
            out.append(override("wandb.job_type", self.job_type))
        out.append(override("wandb.tags", self.tags))
        for key in ("project", "mode"):
            if key in self.wandb:
                out.append(override(f"wandb.{key}", self.wandb[key]))
        return out

    def command(self, extra: Sequence[str] = ()) -> str:
        """The run as one shell command."""
        return shlex.join(["python", "train.py", *self.args(), *extra])

    def metadata(self) -> dict[str, Any]:
        """What the runner stores in ``run.json`` (``compare`` reads it back)."""
        return {
            "experiment": self.experiment,
            "axes": self.labels,
            "seed": self.seed,
            "job_type": self.job_type,
            "wandb_name": self.wandb_name,
            "tags": self.tags,
            "args": self.args(),
            "command": self.command(),
        }


@dataclass
class Experiment:
    """A validated experiment file."""

    name: str
    source: str
    configs: list[str]
    axes: dict[str, list[AxisValue]]
    set: list[str]
    wandb: dict[str, Any]
    job_type_axis: str | None
    runs_dir: Path
    report: dict[str, Any]
    description: str = ""
    #: at most this many runs train as one batched job (``batch_runs:``; 1: one run at a time; None: no limit)
    batch_runs: int | None = None

    def tune_key(self, points: Sequence[AxisValue]) -> tuple[str, ...]:
        """What a choice is made for: the labels of every axis but the seed."""
        return tuple(p.label for p in points if p.axis != "seed")

    @property
    def tuned(self) -> bool:
        return any(p.tune is not None for values in self.axes.values() for p in values)

    def tuning_runs(self, extra: Sequence[str] = ()) -> list[TuneRun]:
        """Every tuning run: for each combination of the non-seed axes whose values carry a ``tune``, each grid
        point × each tuning seed, on the validation split (``data.init_args.val_fraction``)."""
        axes = {a: v for a, v in self.axes.items() if a != "seed"}
        out = []
        for points in itertools.product(*axes.values()) if axes else [()]:
            tune = next((p.tune for p in points if p.tune is not None), None)
            if tune is None:
                continue
            labels = [p.label for p in points]
            configs = list(self.configs) + [c for p in points for c in p.configs]
            base = list(self.set) + [o for p in points for o in p.overrides]
            for label, overrides, values in tune.points():
                for seed in tune.seeds:
                    seed_point = AxisValue("seed", f"s{seed}", f"seed:{seed}", (), (f"--seed_everything={seed}",), seed)
                    run = RunSpec(
                        experiment=self.name,
                        points=(*points, seed_point),
                        configs=configs,
                        overrides=[*base, *overrides, override("data.init_args.val_fraction", tune.val_fraction),
                                   *seed_point.overrides, *extra],
                        run_dir=self.runs_dir.joinpath(self.name, "tune", *labels, label, f"s{seed}"),
                        wandb_name="-".join(["tune", *labels, label, f"s{seed}"]),
                        job_type="tune",
                        tags=[*(p.tag for p in points), f"seed:{seed}", "stage:tune", *self.wandb.get("tags", [])],
                        wandb={k: v for k, v in self.wandb.items() if k != "tags"},
                    )  # fmt: skip
                    out.append(TuneRun(tuple(labels), label, values, run))
        return out

    def runs(self, extra: Sequence[str] = (), chosen: Mapping[tuple[str, ...], Sequence[str]] | None = None
             ) -> list[RunSpec]:  # fmt: skip
        """The product of the axes, in file order (the last axis varies fastest); ``chosen`` (tune key ->
        overrides) adds each tuned method's chosen setting after the axes' overrides."""
        out = []
        for points in itertools.product(*self.axes.values()) if self.axes else [()]:
            labels = [p.label for p in points]
            configs = list(self.configs) + [c for p in points for c in p.configs]
            picked = list((chosen or {}).get(self.tune_key(points), ()))
            overrides = list(self.set) + [o for p in points for o in p.overrides] + picked + list(extra)
            job_type = next((p.label for p in points if p.axis == self.job_type_axis), None)
            out.append(
                RunSpec(
                    experiment=self.name,
                    points=tuple(points),
                    configs=configs,
                    overrides=overrides,
                    run_dir=self.runs_dir.joinpath(self.name, *labels) if labels else self.runs_dir / self.name,
                    wandb_name="-".join(labels) or self.name,
                    job_type=job_type,
                    tags=[p.tag for p in points] + list(self.wandb.get("tags", [])),
                    wandb={k: v for k, v in self.wandb.items() if k != "tags"},
                )
            )
        return out

    @property
    def out_dir(self) -> Path:
        return self.runs_dir / self.name

    def select(self, axis: str, labels: Sequence[str]) -> Experiment:
        """A copy with only these labels of ``axis`` (in the file's order)."""
        known = [p.label for p in self.axes.get(axis, [])]
        unknown = [lab for lab in labels if lab not in known]
        if axis not in self.axes or unknown:
            raise ExperimentError(f"{self.source}: axes.{axis}: no label {unknown or labels} (known: {known})")
        axes = dict(self.axes)
        axes[axis] = [p for p in self.axes[axis] if p.label in labels]
        return dataclasses.replace(self, axes=axes)

    def with_seeds(self, seeds: Sequence[int]) -> Experiment:
        """A copy whose seed axis is ``seeds``."""
        axes = dict(self.axes)
        axes["seed"] = [AxisValue("seed", f"s{v}", f"seed:{v}", (), (f"--seed_everything={v}",), v) for v in seeds]
        return dataclasses.replace(self, axes=axes)


# ---- loading and validation ----------------------------------------------------------------------------------


#: the figures of a run's summary.json (``fl_lightning/engine/summary.py``, the DP engine's, the "+FT" and new-client
#: evaluations) and the prefixes of those the data callbacks add (``mr_``: mixed regression, ``mf_``: low-rank)
SUMMARY_FIGURES = ("final", "last10", "best", "rounds", "wall_s", "upload_bytes", "classes", "top_class_share",
                   "label_top_class_share", "evaluations", "epsilon", "delta", "noise_multiplier", "clip", "dist_B",
                   "final_ft", "new_clients_acc", "new_clients_mse", "peak_device_mb",
                   *(f"{base}_{s}" for base in ("final", "final_ft") for s in ("std", "worst10", "min", "max")))
SUMMARY_PREFIXES = ("mr_", "mf_")


def figure_problem(name: str) -> str | None:
    """Why ``name`` is no ``summary.json`` figure (a typo would give an empty column or no choice), or ``None``."""
    if name in SUMMARY_FIGURES or name.startswith(SUMMARY_PREFIXES):
        return None
    import difflib

    close = difflib.get_close_matches(name, SUMMARY_FIGURES, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{name!r} is not a summary.json figure; {hint}known: {', '.join(SUMMARY_FIGURES[:8])}, … "
            f"(and {'/'.join(SUMMARY_PREFIXES)}* of the data callbacks)")


#: the longest experiment name (a folder name and W&B's group: both refuse far longer ones, not in one line)
MAX_NAME = 100


def load_experiment(path: str | Path, runs_dir: str | Path | None = None) -> Experiment:
    """Read and validate an experiment file; every problem is an :class:`ExperimentError` naming file and key."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file {path} does not exist")
    try:
        data = load_yaml(path)  # a method label or a key given twice is refused, not silently merged
    except ConfigError as exc:
        raise ExperimentError(str(exc)) from None
    return parse_experiment(data, source=str(path), base=path.resolve().parent, runs_dir=runs_dir)


def parse_experiment(
    data: Any, source: str = "<experiment>", base: Path | None = None, runs_dir: str | Path | None = None
) -> Experiment:
    """Validate an experiment given as a mapping (the parsed YAML)."""

    def fail(key: str, message: str) -> ExperimentError:
        return ExperimentError(f"{source}: {key}: {message}" if key else f"{source}: {message}")

    if not isinstance(data, Mapping):
        raise fail("", "expected a mapping with at least 'name'")
    unknown = [k for k in data if k not in TOP_KEYS]
    if unknown:
        raise fail(str(unknown[0]), f"unknown key (known: {', '.join(TOP_KEYS)})")
    name = data.get("name")
    if not isinstance(name, str) or not LABEL.match(name):
        raise fail("name", f"expected a name of letters, digits and _.+=- (got {name!r})")
    if len(name) > MAX_NAME:  # it names the folder runs/<name>/ and the W&B group (at most 128 characters)
        raise fail("name", f"at most {MAX_NAME} characters (it names the folder runs/<name>/ and the W&B group), "
                           f"got {len(name)}: {name[:20]}…; fix: a shorter name")  # fmt: skip

    def config_path(key: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise fail(key, f"expected a config file path, got {value!r}")
        return resolve_path(value, base, lambda: fail(key, f"config file {value} does not exist"))

    def config_list(key: str, value: Any) -> list[str]:
        values = value if isinstance(value, list) else [value]
        return [config_path(f"{key}[{i}]" if isinstance(value, list) else key, v) for i, v in enumerate(values)]

    def overrides_of(key: str, mapping: Mapping) -> list[str]:
        out = []
        for k, v in mapping.items():
            if not isinstance(k, str) or not KEY.match(k):
                raise fail(f"{key}.{k}", "expected a dotted config key such as model.lr")
            out.append(override(k, v))
        return out

    configs = config_list("configs", data["configs"]) if data.get("configs") is not None else []
    set_ = data.get("set") or {}
    if not isinstance(set_, Mapping):
        raise fail("set", "expected a mapping of dotted keys to values")
    set_args = overrides_of("set", set_)

    wandb = dict(data.get("wandb") or {})
    bad = [k for k in wandb if k not in WANDB_KEYS]
    if bad:
        raise fail(f"wandb.{bad[0]}", f"unknown key (known: {', '.join(WANDB_KEYS)}; group, name, job_type and "
                   "tags per run are set by the runner)")  # fmt: skip
    if "tags" in wandb and (not isinstance(wandb["tags"], list) or not all(isinstance(t, str) for t in wandb["tags"])):
        raise fail("wandb.tags", "expected a list of strings")
    if "mode" in wandb and wandb["mode"] not in ("auto", "online", "offline", "disabled"):
        raise fail("wandb.mode", f"expected auto, online, offline or disabled, got {wandb['mode']!r}")

    top_tune = data.get("tune")
    if top_tune is not None:
        if not isinstance(top_tune, Mapping):
            raise fail("tune", "expected a mapping such as {metric: last10, seeds: [100, 101], budget: equal}")
        bad = [k for k in top_tune if k not in (*TUNE_KEYS, "budget", "extend") or k == "grid"]
        if bad:
            raise fail(f"tune.{bad[0]}", "unknown key at the top level (known: seeds, metric, mode, val_fraction, "
                       "scale, bounds, budget, extend; the grid goes in each method's tune)")  # fmt: skip
        if top_tune.get("budget", "equal") not in ("equal", "free"):
            raise fail("tune.budget", f"expected equal or free, got {top_tune['budget']!r}")
        ext = top_tune.get("extend", 0)
        if isinstance(ext, bool) or not isinstance(ext, int) or ext < 0:
            raise fail("tune.extend", f"expected a number of extensions ≥ 0 (0: off), got {ext!r}")
    defaults = {**TUNE_DEFAULTS, **{k: v for k, v in (top_tune or {}).items() if k != "budget"}}
    axes_data = data.get("axes") or {}
    if not isinstance(axes_data, Mapping):
        raise fail("axes", "expected a mapping axis -> values")
    axes: dict[str, list[AxisValue]] = {}
    for axis, values in axes_data.items():
        key = f"axes.{axis}"
        if not isinstance(axis, str) or not KEY.match(axis):
            raise fail(key, "an axis name is a word (method, dataset, seed) or a dotted config key")
        if axis == "seed":
            if not isinstance(values, list) or not values:
                raise fail(key, "expected a non-empty list of integer seeds, e.g. [0, 1, 2]")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise fail(key, f"{v!r} is not an integer seed")
            if len(set(values)) != len(values):
                repeated = next(v for i, v in enumerate(values) if v in values[:i])
                raise fail(key, f"seed {repeated} is given twice (values {values}); fix: list each seed once")
            axes[axis] = [AxisValue("seed", f"s{v}", f"seed:{v}", (), (f"--seed_everything={v}",), v) for v in values]
        elif "." in axis:
            if not isinstance(values, list) or not values:
                raise fail(key, "a dotted-key axis takes a non-empty list of values")
            leaf = axis.rsplit(".", 1)[1]
            repeated = [v for i, v in enumerate(values) if v in values[:i]]
            if repeated:
                raise fail(key, f"{arg_value(repeated[0])} is given twice (values {arg_value(values)}): two runs would "
                           "share one run dir and count as two seeds; fix: list each value once")  # fmt: skip
            points = []
            for v in values:
                if isinstance(v, (dict, list)):
                    raise fail(key, f"{v!r}: a dotted-key axis takes scalar values")
                label = f"{leaf}={arg_value(v)}"
                if not LABEL.match(label):
                    raise fail(key, f"{v!r} cannot be used in a folder name")
                if any(p.label == label for p in points):
                    raise fail(key, f"{v!r} and another value both give the run dir label {label!r}; fix: list each "
                               "value once")  # fmt: skip
                points.append(AxisValue(axis, label, f"{axis}:{arg_value(v)}", (), (override(axis, v),), v))
            axes[axis] = points
        else:
            if not isinstance(values, Mapping) or not values:
                raise fail(key, "expected a mapping label -> {config: FILE(S), dotted.key: value, ...}")
            points = []
            for label, spec in values.items():
                vkey = f"{key}.{label}"
                if not isinstance(label, str) or not LABEL.match(label):
                    raise fail(vkey, "a label is letters, digits and _.+=- (it names folders and W&B runs)")
                if spec is None:
                    spec = {}
                elif isinstance(spec, (str, list)):
                    spec = {"config": spec}
                if not isinstance(spec, Mapping):
                    raise fail(vkey, f"expected a config path or a mapping, got {spec!r}")
                files = config_list(f"{vkey}.config", spec["config"]) if spec.get("config") is not None else []
                rest = {k: v for k, v in spec.items() if k not in ("config", "tune")}
                tune = None
                if "tune" in spec:
                    if axis != "method":
                        raise fail(f"{vkey}.tune", "only values of the method axis can be tuned")
                    tune = parse_tune(spec["tune"], defaults, f"{vkey}.tune", fail)
                points.append(AxisValue(axis, label, f"{axis}:{label}", tuple(files), tuple(overrides_of(vkey, rest)),
                                        tune=tune))  # fmt: skip
            axes[axis] = points
    tuning = {s for p in axes.get("method", []) if p.tune is not None for s in p.tune.seeds}
    clash = sorted(tuning & {p.value for p in axes.get("seed", [])})
    if clash:
        raise fail("axes.seed", f"seed {clash[0]} is also a tuning seed; fix: tuning seeds and the final runs' seeds "
                   "must differ (fresh seeds for the reported runs)")  # fmt: skip
    job_type_axis = data.get("job_type", "method" if "method" in axes else None)
    if job_type_axis is not None and job_type_axis not in axes:
        raise fail("job_type", f"{job_type_axis!r} is not an axis (axes: {', '.join(axes) or 'none'})")

    check_budget(axes, data.get("tune"), fail)
    report = dict(data.get("report") or {})
    bad = [k for k in report if k not in REPORT_KEYS]
    if bad:
        raise fail(f"report.{bad[0]}", f"unknown key (known: {', '.join(REPORT_KEYS)})")
    for k in ("metrics", "by"):
        if k in report:
            if isinstance(report[k], str):
                report[k] = [report[k]]
            if not isinstance(report[k], list) or not all(isinstance(v, str) for v in report[k]):
                raise fail(f"report.{k}", "expected a list of names")
    for figure in report.get("metrics", []):
        problem = figure_problem(figure)
        if problem:
            raise fail("report.metrics", problem)
    curve = report.get("curve")
    if curve is not None and (not isinstance(curve, str) or "/" not in curve):
        raise fail("report.curve", f"expected a metrics.csv column such as val/acc_mean or val/mse_mean, got {curve!r}")
    if "by" in report:
        missing = [b for b in report["by"] if b not in axes and b != "experiment"]
        if missing:
            raise fail("report.by", f"{missing[0]!r} is not an axis (axes: {', '.join(axes)})")
    description = data.get("description") or ""
    batch_runs = data.get("batch_runs")
    if batch_runs is not None and (isinstance(batch_runs, bool) or not isinstance(batch_runs, int) or batch_runs < 1):
        raise fail("batch_runs", f"expected a whole number ≥ 1 (1 turns batching off), got {batch_runs!r}")
    root = Path(runs_dir) if runs_dir is not None else Path(str(data.get("runs_dir") or "runs"))
    return Experiment(
        name=name,
        source=source,
        configs=configs,
        axes=axes,
        set=set_args,
        wandb=wandb,
        job_type_axis=job_type_axis,
        runs_dir=root,
        report=report,
        description=str(description),
        batch_runs=batch_runs,
    )


def parse_tune(value: Any, defaults: Mapping[str, Any], key: str, fail: Any) -> Tune:
    """A method's ``tune`` block (over the top-level defaults); every problem is one line naming the key."""
    if not isinstance(value, Mapping):
        raise fail(key, f"expected a mapping {{grid: {{dotted.key: [values]}}, metric: last10, seeds: [100, 101]}}, "
                   f"got {value!r}")  # fmt: skip
    bad = [k for k in value if k not in TUNE_KEYS]
    if bad:
        more = "; extend is set once, at the top level" if bad[0] == "extend" else ""
        raise fail(f"{key}.{bad[0]}", f"unknown key (known: {', '.join(TUNE_KEYS)}){more}")
    merged = {**defaults, **value}
    grid = merged.get("grid")
    if not isinstance(grid, Mapping) or not grid:
        raise fail(f"{key}.grid", f"expected a mapping dotted.key -> [values], e.g. {{model.lr: [0.01, 0.05]}}, got "
                   f"{grid!r}")  # fmt: skip
    items, leaves = [], set()
    for k, values in grid.items():
        if not isinstance(k, str) or not KEY.match(k) or "." not in k:
            raise fail(f"{key}.grid.{k}", "expected a dotted config key such as model.lr")
        if not isinstance(values, list) or not values or any(isinstance(v, (dict, list)) for v in values):
            raise fail(f"{key}.grid.{k}", f"expected a non-empty list of scalar values, got {values!r}")
        if len({arg_value(v) for v in values}) != len(values):
            raise fail(f"{key}.grid.{k}", f"a value is given twice ({arg_value(values)}); fix: list each value once")
        leaf = k.rsplit(".", 1)[1]
        if leaf in leaves:
            raise fail(f"{key}.grid.{k}", f"two grid keys end in {leaf!r} (the point labels would clash)")
        leaves.add(leaf)
        for v in values:
            if not LABEL.match(f"{leaf}={arg_value(v)}"):
                raise fail(f"{key}.grid.{k}", f"{v!r} cannot be used in a folder name")
        items.append((k, tuple(values)))
    seeds = merged.get("seeds")
    if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
            or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)):  # fmt: skip
        raise fail(f"{key}.seeds", f"expected a non-empty list of distinct integer seeds, got {seeds!r}")
    metric = merged.get("metric")
    if not isinstance(metric, str) or not metric:
        raise fail(f"{key}.metric", f"expected a summary.json figure such as last10, got {metric!r}")
    problem = figure_problem(metric)
    if problem:  # found here, not after the tuning runs have trained
        raise fail(f"{key}.metric", problem)
    if merged.get("mode") not in ("max", "min"):
        raise fail(f"{key}.mode", f"expected max or min, got {merged.get('mode')!r}")
    vf = merged.get("val_fraction")
    if isinstance(vf, bool) or not isinstance(vf, (int, float)) or not 0 < vf < 1:
        raise fail(f"{key}.val_fraction", f"expected a fraction in (0, 1) (tuning reads the validation split), "
                   f"got {vf!r}")  # fmt: skip
    grid_keys = [k for k, _ in items]
    scale = axis_settings("scale", defaults, value, grid_keys, key, fail)
    for k, v in scale.items():
        if v not in ("log", "linear"):
            raise fail(f"{key}.scale.{k}", f"expected log or linear, got {v!r}")
    bounds = axis_settings("bounds", defaults, value, grid_keys, key, fail)
    for k, v in bounds.items():
        if (not isinstance(v, list) or len(v) != 2
                or any(b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))) for b in v)
                or (None not in v and v[0] > v[1])):  # fmt: skip
            raise fail(f"{key}.bounds.{k}", f"expected [low, high] (numbers or null, low ≤ high), got {v!r}")
    return Tune(
        tuple(items), tuple(seeds), metric, merged["mode"], float(vf), int(merged.get("extend", 0)),
        tuple(scale.items()), tuple((k, (v[0], v[1])) for k, v in bounds.items()),
    )  # fmt: skip


def axis_settings(name: str, defaults: Mapping[str, Any], value: Mapping[str, Any], grid: list[str], key: str,
                  fail: Any) -> dict[str, Any]:  # fmt: skip
    """``scale`` or ``bounds`` of one method: the top level's entries for its grid keys, then its own (which must
    name grid keys)."""
    out = {}
    for where, given, strict in ((f"tune.{name}", defaults.get(name), False), (f"{key}.{name}", value.get(name), True)):
        if given is None:
            continue
        if not isinstance(given, Mapping):
            raise fail(where, f"expected a mapping dotted.key -> value, got {given!r}")
        for k, v in given.items():
            if k in grid:
                out[k] = v
            elif strict:
                raise fail(f"{where}.{k}", f"not a key of this method's grid ({', '.join(grid)})")
    return out


def check_budget(axes: Mapping[str, list[AxisValue]], top: Any, fail: Any) -> None:
    """``budget: equal`` (the default): every method of a tuned file gets the same number of tuning trials."""
    methods = axes.get("method", [])
    if not any(p.tune is not None for p in methods) or (isinstance(top, Mapping) and top.get("budget") == "free"):
        return
    trials = {p.label: p.tune.trials if p.tune is not None else 0 for p in methods}
    if len(set(trials.values())) > 1:
        (a, na), (b, nb) = sorted(trials.items(), key=lambda kv: kv[1])[:: len(trials) - 1]
        raise fail("axes.method", f"unequal tuning budgets: {a} gets {na} trials, {b} {nb} (grid points × tuning "
                   "seeds); fix: equal grids, or tune.budget: free")  # fmt: skip


def resolve_path(value: str, base: Path | None, error: Any) -> str:
    """``value`` as given when it exists from the working directory, else found relative to ``base`` or one of
    its parents (the repository root for the files in ``configs/experiments/``); absolute paths as they are."""
    path = Path(value)
    if path.is_file():
        return value
    if not path.is_absolute() and base is not None:
        for folder in (base, *base.parents):
            if (folder / path).is_file():
                return str(folder / path)
    raise error()


@dataclass
class Outcome:
    """What became of one run of the grid (``runner.execute``)."""

    run: RunSpec
    status: str  # done, skipped, failed, interrupted
    error: str = ""
    seconds: float = 0.0


@dataclass
class Choice:
    """The tuning outcome of one combination of the non-seed axes: the chosen point (``None``: no winner, a
    tuning run is missing), its overrides, every point's mean and the number of trials."""

    key: tuple[str, ...]
    axes: dict[str, str]
    metric: str
    point: str | None
    overrides: list[str]
    means: dict[str, float]
    trials: int
    seeds: list[int]
    missing: list[str] = field(default_factory=list)
    #: the numeric axes on which the winner is left at an edge, each with what stopped the extension
    edges: list[str] = field(default_factory=list)
    #: the tuning points whose runs failed during the grid extension (tried and lost)
    lost: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The chosen point as the table shows it: flagged when it sits on a grid edge."""
        return "-" if self.point is None else self.point + "".join(f" [edge: {e}]" for e in self.edges)

    def record(self) -> dict[str, Any]:
        names = ("axes", "metric", "point", "overrides", "means", "trials", "seeds", "missing", "edges", "lost")
        return {("chosen" if n == "point" else "tuning_seeds" if n == "seeds" else n): getattr(self, n) for n in names}
