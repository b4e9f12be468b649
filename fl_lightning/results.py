"""Results records (the ``results.json`` format), plain-text tables and bar charts, shared by the experiment
runner, the reproductions and the benchmarks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def record(
    experiment: str, method: str, metric: str, value: float, seed: int | None = None, setting: str | None = None
) -> dict[str, Any]:
    """One ``results.json`` row."""
    row: dict[str, Any] = {"experiment": experiment, "method": method, "metric": metric, "value": float(value)}
    if seed is not None:
        row["seed"] = int(seed)
    if setting is not None:
        row["setting"] = str(setting)
    return row


#: the summary figure of a run's "+FT" evaluation (evaluated once, at the end of training)
FINETUNED = "final_ft"


def finetuned_figure(key: str) -> str | None:
    """The "+FT" counterpart of a plain summary figure: ``final``, ``last10`` and ``best`` → ``final_ft`` (the
    fine-tuned model is evaluated once, at the end), ``final_<spread>`` → ``final_ft_<spread>``; else None."""
    if key in ("final", "last10", "best"):
        return FINETUNED
    if key.startswith("final_") and not key.startswith(FINETUNED):
        return f"{FINETUNED}_{key[len('final_') :]}"
    return None


def reported_figure(summary: dict[str, Any], key: str = "last10") -> float:
    """The figure a method's row reports: ``key`` of a plain run; of a "+FT" run (its summary has ``final_ft``)
    the fine-tuned counterpart of ``key`` (``finetuned_figure``), since that row is the "+FT" method."""
    ft = finetuned_figure(key)
    return float(summary[ft] if FINETUNED in summary and ft is not None and ft in summary else summary[key])


def write_results(records: list[dict[str, Any]], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def table_cell(v: Any) -> str:
    """A cell of the reproductions' and benchmarks' tables: floats to 4 decimals, tiny or huge ones in exponent
    notation, NaN as ``-``."""
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3e}" if (abs(v) < 1e-2 and v != 0) or abs(v) >= 1e5 else f"{v:.4f}"
    return str(v)


def summary_cell(v: Any) -> str:
    """A cell of a run's summary table (``train.py``'s last lines): 4 significant digits below 0.01, 4 decimals
    below 10, one decimal above."""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e-2 and v != 0 else f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


#: the first columns of a run's summary table, in this order; the summary's other keys follow
SUMMARY_COLUMNS = ("algorithm", "metric", "final", "last10", "rounds", "wall_s")


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """Run summaries as a table: ``SUMMARY_COLUMNS``, then every other key in order of appearance (``dist_B``,
    ``new_clients_*``, ``mf/…``); a run without a key leaves its cell empty."""
    headers = [*SUMMARY_COLUMNS, *dict.fromkeys(k for r in rows for k in r if k not in SUMMARY_COLUMNS)]
    return format_table(headers, [[r.get(h, "") for h in headers] for r in rows], summary_cell)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], cell: Callable[[Any], str] = table_cell) -> str:
    """A plain-text table: the headers, a rule, one line per row, columns padded to their widest cell."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(c[i]) for c in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths))
    return "\n".join([line, "-" * len(line), *("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells)])


def bar_chart(
    path: Path,
    labels: Sequence[str],
    values: Sequence[float],
    ylabel: str,
    title: str,
    reference: Sequence[float] | None = None,
    reference_label: str = "paper",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(labels) + 2), 4))
    xs = range(len(labels))
    width = 0.4 if reference is not None else 0.7
    ax.bar([x - (width / 2 if reference is not None else 0) for x in xs], values, width, label="fl_lightning")
    if reference is not None:
        ax.bar([x + width / 2 for x in xs], reference, width, label=reference_label, alpha=0.6)
        ax.legend()
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
