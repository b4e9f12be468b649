"""The README's generated tables, rendered from what the commands wrote, and the check that they still agree.

A generated block of ``README.md`` sits between ``<!-- generated: NAME -->`` and ``<!-- /generated -->``; its text is
rendered from a file that a command wrote and that is kept under ``docs/measured/``:

* ``quickstart``: the result table that ``make train`` prints, from its ``runs/quickstart/summary.json``
  (copied to ``docs/measured/quickstart_summary.json``), rendered by ``fl_lightning.results.summary_table`` as
  train.py does;
* ``dp``: the accuracy-against-ε table of ``python -m experiments dp``, from its ``results/dp/results.json`` (copied
  to ``docs/measured/dp_results.json``): mean ± population std over seeds, in %, per σ, as the command prints it;
* ``batched_runs``: the grids of ``python -m benchmarks.batched_runs --workloads table1_digits digits_4x5``, from its
  ``results/bench/run_axis/results.json`` (copied to ``docs/measured/batched_runs_results.json``): each grid's
  CPU and wall seconds on both sides with their ratios, then each side's CPU seconds by part and the ceiling.

    python tools/readme_tables.py --check          # exit 1 naming each block that differs from its source
    python tools/readme_tables.py --write          # rewrite the blocks from the sources
    python tools/readme_tables.py --copy quickstart runs/quickstart/summary.json   # a new measurement; then --write
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # python tools/readme_tables.py: this checkout's fl_lightning
    sys.path.insert(0, str(ROOT))
README = ROOT / "README.md"
SOURCES = {"quickstart": ROOT / "docs/measured/quickstart_summary.json", "dp": ROOT / "docs/measured/dp_results.json",
           "batched_runs": ROOT / "docs/measured/batched_runs_results.json"}  # fmt: skip
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- /generated -->)", re.S)

#: the DP table's columns: the method's name in results.json -> its header
DP_COLUMNS = {
    "FedAvg": "FedAvg (global model)",
    "FedRep": "FedRep (body private, head local)",
    "Ditto": "Ditto (global private, personal local)",
}


def quickstart(summary: dict[str, Any]) -> str:
    """``make train``'s result table and its last line, as printed (``fl_lightning.cli._fit``)."""
    from fl_lightning.results import summary_table

    printed = {k: v for k, v in summary.items() if k != "ran"}  # train.py prints the table before adding what ran
    table = "\n".join(line.rstrip() for line in summary_table([printed]).splitlines())  # less the cells' padding
    return "```\n" + table + "\nrun: runs/quickstart\n```\n"


def _percent(values: list[float]) -> str:
    return f"{100 * statistics.fmean(values):.1f} ± {100 * statistics.pstdev(values):.1f}"


def dp(records: list[dict[str, Any]]) -> str:
    """The table of ``python -m experiments dp`` (its printed one, as markdown) and its Local Only line."""
    acc: dict[str, dict[float, list[float]]] = {}
    eps: dict[float, float] = {}
    local = []
    for r in records:
        if r["method"] == "Local Only":
            local.append(r["value"])
            continue
        sigma = float(r["setting"].removeprefix("sigma="))
        if r["metric"] == "acc":
            acc.setdefault(r["method"], {}).setdefault(sigma, []).append(r["value"])
        elif r["metric"] == "epsilon":
            eps[sigma] = r["value"]
    methods = [m for m in DP_COLUMNS if m in acc] + sorted(set(acc) - set(DP_COLUMNS))
    lines = ["| σ | ε | " + " | ".join(DP_COLUMNS.get(m, m) for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]  # fmt: skip
    for sigma in sorted(eps):
        shown = f"{eps[sigma]:.3g}" if math.isfinite(eps[sigma]) else "∞"
        lines.append(f"| {sigma:g} | {shown} | " + " | ".join(_percent(acc[m][sigma]) for m in methods) + " |")
    text = "\n".join(lines) + "\n"
    if local:
        text += f"\nLocal Only (nothing uploaded, ε = 0), same rounds and seeds: {_percent(local)}.\n"
    return text


#: the grids of ``benchmarks.batched_runs``: workload -> (its row's name, its short name in the parts table)
GRIDS = {"table1_digits": ("`make reproduce-table1-digits`", "Table 1"),
         "digits_4x5": ("FedAvg, FedProx, Ditto, FedRep of Table 1", "4 × 5")}  # fmt: skip


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


def batched_runs(records: list[dict[str, Any]]) -> str:
    """The grids' table (both sides' CPU and wall seconds, the ratios, the largest difference of any final / last10 /
    best) and the CPU seconds by part (``benchmarks.batched_runs.cpu_parts``), with each grid's ceiling."""
    figures: dict[str, dict[str, float]] = {}
    parts: dict[str, dict[str, dict[str, float]]] = {}
    settings: dict[str, dict[str, str]] = {}
    for r in records:
        if r["experiment"] not in GRIDS:
            continue
        settings[r["experiment"]] = dict(kv.split("=") for kv in r["setting"].split(",")[1:])
        if r["metric"].startswith("cpu_s:"):
            parts.setdefault(r["experiment"], {}).setdefault(r["method"], {})[r["metric"][6:]] = r["value"]
        else:
            figures.setdefault(r["experiment"], {})[r["metric"]] = r["value"]
    grids = [g for g in GRIDS if g in figures]
    header = ("grid", "same runs one at a time, sequential executor", "default command", "CPU ratio", "wall ratio",
              "largest difference")  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for g in grids:
        f, s = figures[g], settings[g]
        diff = "0 (every final, last10, best)" if f["max_abs_diff"] == 0 else f"{f['max_abs_diff']:.2g}"
        cells = [f"{GRIDS[g][0]} ({s['methods']} methods × {s['seeds']} seeds, {s['rounds']} rounds)",
                 f"{_seconds(f['ref_cpu_s'])} CPU / {_seconds(f['ref_wall_s'])} wall",
                 f"{_seconds(f['cpu_s'])} / {_seconds(f['wall_s'])}", f"{f['speedup_cpu']:.2f}×",
                 f"{f['speedup_wall']:.2f}×", diff]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    sides = [f"{GRIDS[g][1]}, {side}" for g in grids for side in ("sequential", "default")]
    lines += ["", "| part | " + " | ".join(sides) + " |", "|---" * (1 + len(sides)) + "|"]
    for part in parts[grids[0]]["sequential"]:
        cells = []
        for g in grids:
            ref, fast = parts[g]["sequential"][part], parts[g]["default command"][part]
            cells += [_seconds(ref), _seconds(fast) + (f" ({ref / fast:.2f}×)" if part.startswith("client") else "")]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    ceilings = " and ".join(f"{figures[g]['speedup_cpu_ceiling']:.2f}× on {GRIDS[g][1]}" for g in grids)
    lines += ["", f"Ceiling of the CPU ratio with client training and evaluation free: {ceilings}."]
    return "\n".join(lines) + "\n"


RENDER: dict[str, Callable[[Any], str]] = {"quickstart": quickstart, "dp": dp, "batched_runs": batched_runs}


def render(name: str, source: Path | None = None) -> str:
    return RENDER[name](json.loads((source or SOURCES[name]).read_text()))


def differences(text: str) -> list[str]:
    """The names of the README's generated blocks whose text is not what their source renders."""
    return [m.group(2) for m in BLOCK.finditer(text) if m.group(3) != render(m.group(2))]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/readme_tables.py", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--check", action="store_true", help="exit 1 when a block differs from its source")
    group.add_argument("--write", action="store_true", help="rewrite the blocks from their sources")
    group.add_argument("--copy", nargs=2, metavar=("NAME", "FILE"), help="keep FILE as the source of block NAME")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    if args.copy:
        name, path = args.copy
        if name not in SOURCES:
            parser.error(f"unknown block {name!r}; pick from {', '.join(SOURCES)}")
        SOURCES[name].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SOURCES[name])
        print(f"{path} -> {SOURCES[name].relative_to(ROOT)}; now: python tools/readme_tables.py --write")
        return 0
    text = args.readme.read_text()
    if args.write:
        args.readme.write_text(rewrite(text))
        return 0
    stale = differences(text)
    for name in stale:
        print(f"error: README block '{name}' differs from {SOURCES[name].relative_to(ROOT)}; fix: python "
              "tools/readme_tables.py --write", file=sys.stderr)  # fmt: skip
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
