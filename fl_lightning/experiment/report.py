"""Tables (mean ± std over seeds), ``results.json`` records and plots from finished runs.

Units: accuracies are fractions in every log (``metrics.csv``, ``summary.json``, W&B, ``results.json``) and
percent in every table and plot; the headers say so. The spread is the sample standard deviation over the runs
of a group (normally its seeds, ``ddof = 1``), shown with the number of runs ``n``.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.experiment.collect import RunResult
from fl_lightning.results import FINETUNED, finetuned_figure, record, reported_figure

NOT_ACCURACY = ("loss", "bytes", "wall", "rounds", "mse", "dist", "samples", "seconds", "classes")
#: a run is "at chance" when its mean client accuracy is within this fraction of the way from chance to 1
AT_CHANCE_MARGIN = 0.05
#: a run's models "predict one class" when at least this share of all their test predictions is one class
ONE_CLASS_SHARE = 0.9
LOCAL_ONLY = "LocalOnly"
MAIN_FIGURES = ("final", "last10", "best")
FORMATS = ("md", "csv", "latex")


def is_accuracy(key: str, run_metric: str = "acc") -> bool:
    """Whether summary figure ``key`` is an accuracy (a fraction, shown in percent)."""
    if any(w in key for w in NOT_ACCURACY):
        return False
    return "acc" in key or (run_metric == "acc" and key.split("_")[0] in (*MAIN_FIGURES, "worst10", "min", "std"))


def metric_name(key: str, run_metric: str) -> str:
    """The name of a summary figure in tables and records: ``last10`` of an accuracy run is ``acc_last10``."""
    return f"{run_metric}_{key}" if key in MAIN_FIGURES else key


def default_by(results: Sequence[RunResult]) -> list[str]:
    """Group by every axis but the seed (in the order the runs name them) that has more than one label among
    ``results`` (and by experiment when they come from several); ``method`` when nothing varies."""
    by: list[str] = []
    for r in results:
        for axis in r.axes:
            if axis != "seed" and axis not in by and len({q.label(axis) for q in results}) > 1:
                by.append(axis)
    if len({r.experiment for r in results}) > 1:
        by.insert(0, "experiment")
    return by or ["method"]


@dataclass
class Cell:
    values: list[float]
    percent: bool

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else math.nan

    def scaled(self, v: float) -> float:
        return 100 * v if self.percent else v


@dataclass
class Table:
    by: list[str]
    metrics: list[str]
    rows: list[tuple[tuple[str, ...], dict[str, Cell], int]]  # (labels, metric -> cell, runs in the group)
    flags: dict[tuple[str, ...], str] = field(default_factory=dict)  # labels -> what is wrong with the group
    #: labels -> (chosen setting, tuning trials), for a tuned experiment (spec.py's ``tune``)
    tuned: dict[tuple[str, ...], tuple[str, str]] = field(default_factory=dict)

    def _tuned(self, labels: tuple[str, ...]) -> list[str]:
        return list(self.tuned.get(labels, ("-", "0"))) if self.tuned else []

    def headers(self) -> list[str]:
        out = list(self.by) + (["chosen", "trials"] if self.tuned else [])
        for m in self.metrics:
            percent = any(cells[m].percent for _, cells, _ in self.rows if m in cells)
            out.append(f"{m} ({'%, ' if percent else ''}mean ± std)")
        return [*out, *(["flags"] if self.flags else []), "n"]

    def note(self) -> str:
        text = (
            "mean ± sample std over the runs of each group (its seeds), n = number of runs; "
            "accuracies in percent here, fractions in metrics.csv / summary.json / W&B / results.json"
        )
        if any(FINETUNED in m for m in self.metrics):
            text += "; final/last10/best are the plain runs', final_ft* their \"+FT\" evaluation (once, at the end)"
        if self.tuned:
            text += ("; chosen = the grid point picked on the validation split (best mean over the tuning seeds), "
                     "trials = tuning runs (grid points × tuning seeds); the figures are fresh-seed test runs")
        if self.flags:
            text += (
                f"; flags: 'at chance' = a run's mean client accuracy (last10) within {AT_CHANCE_MARGIN:.0%} of the "
                f"way from chance (1/classes) to 1, a collapse, not the method's result; 'predicts one class' = "
                f"at least {ONE_CLASS_SHARE:.0%} of a run's final test predictions are one class (rarer among the "
                f"labels); 'below Local-only' = the "
                f"first figure under that of Local-only with the same other labels"
            )
        return text

    def _flag(self, labels: tuple[str, ...]) -> list[str]:
        return [self.flags.get(labels, "")] if self.flags else []

    def formatted(self, fmt: str = "md") -> str:
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
        if fmt == "csv":
            return self._csv()
        latex = fmt == "latex"
        cells = [[*labels, *self._tuned(labels), *(self._cell(cells.get(m), latex=latex) for m in self.metrics),
                  *self._flag(labels), str(n)]
                 for labels, cells, n in self.rows]  # fmt: skip
        headers = self.headers()
        if fmt == "latex":
            head = " & ".join(h.replace("%", r"\%").replace("±", r"$\pm$").replace("_", r"\_") for h in headers)
            body = [" & ".join(c.replace("_", r"\_") for c in row) + r" \\" for row in cells]
            left = len(self.by) + (2 if self.tuned else 0)
            spec = "l" * left + "r" * (len(headers) - left)
            return "\n".join(
                [f"% {self.note()}", rf"\begin{{tabular}}{{{spec}}}", r"\toprule", head + r" \\", r"\midrule",
                 *body, r"\bottomrule", r"\end{tabular}"]
            )  # fmt: skip
        widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
        line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
        left = len(self.by) + (2 if self.tuned else 0)
        rule = "|" + "|".join(("-" * (w + 1) + ":") if i >= left else "-" * (w + 2)
                              for i, w in enumerate(widths)) + "|"  # fmt: skip
        rows = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
        return "\n".join([line, rule, *rows, "", self.note()])

    def _cell(self, cell: Cell | None, latex: bool = False) -> str:
        if cell is None or not cell.values:
            return "-"
        digits = 2 if cell.percent else 4
        mean = cell.scaled(cell.mean)
        text = _num(mean, digits)
        if cell.n > 1:
            pm = r" $\pm$ " if latex else " ± "
            text += pm + _num(cell.scaled(cell.std), digits)
        return text

    def _csv(self) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        head = list(self.by) + (["chosen", "trials"] if self.tuned else [])
        for m in self.metrics:
            unit = " (%)" if any(cells[m].percent for _, cells, _ in self.rows if m in cells) else ""
            head += [f"{m} mean{unit}", f"{m} std{unit}"]
        w.writerow([*head, *(["flags"] if self.flags else []), "n"])
        for labels, cells, n in self.rows:
            row: list[Any] = [*labels, *self._tuned(labels)]
            for m in self.metrics:
                c = cells.get(m)
                row += ["", ""] if c is None else [_num(c.scaled(c.mean), 6), _num(c.scaled(c.std), 6)]
            w.writerow([*row, *self._flag(labels), n])
        return buf.getvalue().rstrip("\n")


def _num(v: float, digits: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v != 0 and (abs(v) < 10 ** (-digits) or abs(v) >= 1e6):
        return f"{v:.3e}"
    return f"{v:.{digits}f}"


def make_table(
    results: Sequence[RunResult],
    by: Sequence[str] | None = None,
    metrics: Sequence[str] = ("last10",),
    tuned: Sequence[tuple[dict[str, str], str, int]] | None = None,
) -> Table:
    """Group ``results`` by the labels of ``by`` (default: every axis but the seed) and average each summary
    figure in ``metrics`` over the runs of each group. Groups keep the order in which runs first name them.
    When some run has a "+FT" result, each figure's "+FT" counterpart (``final_ft``, ``final_ft_worst10``, …) is
    its own column: ``final``/``last10``/``best`` are always the plain run's, so no column mixes the two."""
    by = list(by) if by else default_by(results)
    metrics = with_finetuned(results, metrics)
    groups: dict[tuple[str, ...], list[RunResult]] = {}
    for r in results:
        groups.setdefault(r.key(by), []).append(r)
    rows = []
    for labels, runs in groups.items():
        cells = {}
        for m in metrics:
            values = [float(r.summary[m]) for r in runs if isinstance(r.summary.get(m), (int, float))]
            values = [v for v in values if not math.isnan(v)]
            cells[m] = Cell(values, all(is_accuracy(m, r.metric) for r in runs))
        rows.append((labels, cells, len(runs)))
    table = Table(by, list(metrics), rows, collapse_flags(groups, by, metrics[0] if metrics else "last10"))
    table.tuned = tuned_cells(list(groups), by, tuned or [])
    return table


def tuned_cells(
    groups: list[tuple[str, ...]], by: Sequence[str], tuned: Sequence[tuple[dict[str, str], str, int]]
) -> dict[tuple[str, ...], tuple[str, str]]:
    """Per table row, the chosen setting and the tuning trials of the tuning outcomes (axes labels, chosen point,
    trials) whose labels match the row on every axis of ``by``; several different ones are joined with " / "."""
    out = {}
    for labels in groups:
        pairs = [(a, lab) for a, lab in zip(by, labels) if a not in ("seed", "experiment")]
        mine = [(c, n) for axes, c, n in tuned if all(axes.get(a, lab) == lab for a, lab in pairs)]
        if mine:
            out[labels] = (" / ".join(dict.fromkeys(c for c, _ in mine)), str(sum(n for _, n in mine)))
    return out


def at_chance(run: RunResult) -> bool:
    """Whether the run's mean client accuracy (``last10``, else ``final``; the plain run) is at chance: within
    ``AT_CHANCE_MARGIN`` of the way from 1/classes to 1. Unknown (False) without ``classes`` in the summary."""
    classes, value = run.summary.get("classes"), run.summary.get("last10", run.summary.get("final"))
    if run.metric != "acc" or not isinstance(classes, int) or classes < 2 or not isinstance(value, (int, float)):
        return False
    chance = 1.0 / classes
    return float(value) < chance + AT_CHANCE_MARGIN * (1.0 - chance)


def predicts_one_class(run: RunResult) -> bool:
    """Whether the run's models put at least ``ONE_CLASS_SHARE`` of all their final predictions into one class
    while the labels' most frequent class is rarer (``top_class_share`` and ``label_top_class_share`` of the
    summary, written by ``engine.evaluation.class_shares``); unknown (False) without them."""
    predicted, labels = run.summary.get("top_class_share"), run.summary.get("label_top_class_share")
    if not isinstance(predicted, (int, float)) or not isinstance(labels, (int, float)):
        return False
    return predicted >= ONE_CLASS_SHARE > labels


def collapse_flags(groups: dict[tuple[str, ...], list[RunResult]], by: Sequence[str], key: str) -> dict:
    """What to say beside a group's numbers: runs at chance (``at_chance``), runs whose models predict one class
    (``predicts_one_class``), and a mean ``key`` (the "+FT" figure
    for a "+FT" run, ``reported_figure``) below that of the Local-only group with the same labels on every other
    axis of ``by``; "" when nothing."""
    def mean_of(runs: list[RunResult]) -> float:
        values = [reported_figure(r.summary, key) for r in runs if isinstance(r.summary.get(key), (int, float))]
        return statistics.fmean(values) if values else math.nan

    local = {k: runs for k, runs in groups.items() if all(r.summary.get("algorithm") == LOCAL_ONLY for r in runs)}
    lower_is_better = any(r.metric != "acc" for runs in groups.values() for r in runs)
    flags = {}
    for labels, runs in groups.items():
        out = []
        collapsed = sum(at_chance(r) for r in runs)
        if collapsed:
            out.append(f"at chance ({collapsed}/{len(runs)} runs)")
        one_class = sum(predicts_one_class(r) for r in runs)
        if one_class:
            out.append(f"predicts one class ({one_class}/{len(runs)} runs)")
        if labels not in local and not lower_is_better:
            for local_labels, local_runs in local.items():
                differ = [a for a, x, y in zip(by, labels, local_labels) if x != y]
                mine, theirs = mean_of(runs), mean_of(local_runs)
                if differ and all(a == "method" for a in differ) and mine < theirs:
                    scale = 100 if is_accuracy(key, runs[0].metric) else 1
                    out.append(f"below Local-only ({scale * mine:.2f} < {scale * theirs:.2f})")
        if out:
            flags[labels] = "; ".join(out)
    return flags


def with_finetuned(results: Sequence[RunResult], metrics: Sequence[str]) -> list[str]:
    """``metrics``, each followed by its "+FT" counterpart when some run has a "+FT" result (once each)."""
    out = list(dict.fromkeys(metrics))
    if any(FINETUNED in r.summary for r in results):
        for m in metrics:
            ft = finetuned_figure(m)
            if ft is not None and ft not in out:
                out.insert(out.index(m) + 1, ft)
    return out


def results_records(results: Sequence[RunResult], table: Table | None = None) -> list[dict[str, Any]]:
    """``results.json`` records (fractions): every numeric summary figure of every run, with its seed and the
    other axis labels as ``setting``; plus, for the table, ``<figure>_mean`` / ``_std`` per group."""
    out = []
    for r in results:
        method = r.axes.get("method", "-")
        setting = ",".join(f"{a}={l}" for a, l in r.axes.items() if a not in ("method", "seed")) or None
        for k, v in r.summary.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(record(r.experiment, method, metric_name(k, r.metric), v, seed=r.seed, setting=setting))
    if table is not None:
        for labels, cells, _ in table.rows:
            group = dict(zip(table.by, labels))
            runs = [r for r in results if r.key(table.by) == labels]
            experiment = group.get("experiment") or runs[0].experiment
            method = group.get("method", runs[0].axes.get("method", "-"))
            setting = ",".join(f"{a}={l}" for a, l in group.items() if a not in ("method", "experiment")) or None
            for m, cell in cells.items():
                name = metric_name(m, runs[0].metric)
                if cell.values:
                    out.append(record(experiment, method, f"{name}_mean", cell.mean, setting=setting))
                if cell.n > 1:
                    out.append(record(experiment, method, f"{name}_std", cell.std, setting=setting))
    return out


# ---- plots --------------------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curve_key(results: Sequence[RunResult]) -> str:
    return "val/mse_mean" if results and all(r.metric == "mse" for r in results) else "val/acc_mean"


def plot_curves(results: Sequence[RunResult], by: Sequence[str], key: str, path: Path) -> Path | None:
    """``key`` vs round, one line per group: the mean over its runs and a ± std band (rounds all runs logged)."""
    groups: dict[tuple[str, ...], list[RunResult]] = {}
    for r in results:
        if r.curves.get(key):
            groups.setdefault(r.key(by), []).append(r)
    if not groups:
        return None
    import numpy as np

    percent = "acc" in key
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (labels, runs) in enumerate(groups.items()):
        series = [dict(r.curves[key]) for r in runs]
        steps = sorted(set.intersection(*(set(s) for s in series)))
        if not steps:
            continue
        values = np.array([[s[t] for t in steps] for s in series]) * (100 if percent else 1)
        mean, std = values.mean(0), values.std(0, ddof=1) if len(runs) > 1 else np.zeros(len(steps))
        x = np.array(steps) + 1
        name = "/".join(labels) + f" (n={len(runs)})"
        ax.plot(x, mean, color=f"C{i % 10}", label=name, lw=1.5)
        ax.fill_between(x, mean - std, mean + std, color=f"C{i % 10}", alpha=0.2, lw=0)
    ax.set_xlabel("communication round")
    ax.set_ylabel(f"{key} ({'%' if percent else 'value'})")
    ax.set_title(f"{key}: mean ± std over seeds")
    ax.legend(fontsize=7, ncol=2 if len(groups) > 8 else 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_clients(results: Sequence[RunResult], by: Sequence[str], path: Path) -> Path | None:
    """The final per-client test accuracy per group (box plot, every seed's clients pooled; mean as a dot)."""
    groups: dict[tuple[str, ...], list[float]] = {}
    for r in results:
        if r.clients:
            values = [100 * c["accuracy"] for c in r.clients if c.get("samples", 1) > 0 and "accuracy" in c]
            groups.setdefault(r.key(by), []).extend(values)
    if not groups:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(groups) + 2), 4.2))
    names = ["/".join(k) for k in groups]
    ax.boxplot(list(groups.values()), showfliers=True)
    ax.plot(range(1, len(groups) + 1), [statistics.fmean(v) for v in groups.values()], "o", color="C3", label="mean")
    ax.set_xticks(range(1, len(groups) + 1))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_ylabel("client test accuracy (%)")
    ax.set_title("per-client accuracy at the end of training (all seeds pooled)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(
    results: Sequence[RunResult],
    out_dir: Path,
    by: Sequence[str] | None = None,
    metrics: Sequence[str] = ("last10",),
    fmt: str = "md",
    curve: str | None = None,
    title: str = "",
    tuned: Sequence[tuple[dict[str, str], str, int]] | None = None,
) -> tuple[str, Path, list[Path]]:
    """Print-ready table text, ``results.json`` and PNGs in ``out_dir``; ``tuned`` (axis labels, chosen point,
    trials per tuned combination) adds the "chosen" and "trials" columns."""
    from fl_lightning.results import write_results

    table = make_table(results, by, metrics, tuned)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = table.formatted(fmt)
    if title and fmt == "md":
        text = f"{title}\n\n{text}"
    ext = {"md": "md", "csv": "csv", "latex": "tex"}[fmt]
    (out_dir / f"table.{ext}").write_text(text + "\n")
    path = write_results(results_records(results, table), out_dir)
    key = curve or curve_key(results)
    plots = [
        p
        for p in (
            plot_curves(results, table.by, key, out_dir / f"curve_{key.replace('/', '_')}.png"),
            plot_clients(results, table.by, out_dir / "clients_accuracy.png"),
        )
        if p is not None
    ]
    return text, path, plots
