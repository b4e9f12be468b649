"""FedRep's Table 1 (spec 000 §4.1): every method in every column, next to the paper's numbers.

Each column is an experiment file run by the generic runner (``python -m fl_lightning.experiment run``):
``configs/experiments/table1_digits.yaml`` (the bundled digits split, ``--dataset digits``, the default) and
``configs/experiments/table1_<column>.yaml`` for the paper's columns (``--dataset real``; the data must be on disk),
15 methods × 3 seeds each, with the paper's per-column settings as overrides in the files. This wrapper picks a
sub-grid (``--columns``, ``--methods``, ``--seeds N``, ``--rounds T``; other rounds make another experiment with its
own run dirs), prints mean ± std over seeds next to the paper and the ordering checks on the means, and writes
``table1.csv``, ``table1_<column>.png`` and ``results.json`` (fractions) under ``--out``. Finished runs in
``runs/<experiment>/`` are reused, unfinished ones resumed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments import ROOT
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.report import results_records
from fl_lightning.experiment.runner import run_experiment
from fl_lightning.experiment.spec import Experiment, load_experiment
from fl_lightning.results import bar_chart, format_table, reported_figure, write_results

CONFIGS = ROOT / "configs"

# (display name, config stem) in the paper's row order
METHODS: list[tuple[str, str]] = [
    ("Local Only", "local"),
    ("FedAvg", "fedavg"),
    ("FedAvg+FT", "fedavg_ft"),
    ("FedProx", "fedprox"),
    ("FedProx+FT", "fedprox_ft"),
    ("SCAFFOLD", "scaffold"),
    ("SCAFFOLD+FT", "scaffold_ft"),
    ("Fed-MTL", "fedmtl"),
    ("PerFedAvg", "perfedavg"),
    ("LG-Fed", "lg_fedavg"),
    ("L2GD", "l2gd"),
    ("APFL", "apfl"),
    ("Ditto", "ditto"),
    ("FedPer", "fedper"),
    ("FedRep", "fedrep"),
]
LABEL = {m: n for n, m in METHODS}
GLOBAL_MODELS = ("fedavg", "fedprox", "scaffold")  # evaluated with one global model
REAL_COLUMNS = [
    "cifar10_100x2",
    "cifar10_100x5",
    "cifar10_1000x2",
    "cifar100_100x5",
    "cifar100_100x20",
    "sent140_183x2",
    "femnist_150x3",
]

# Table 1 verbatim (spec 000 §4.1), columns in REAL_COLUMNS order.
PAPER: dict[str, list[float]] = {
    "local": [89.79, 70.68, 78.30, 75.29, 41.29, 69.88, 60.86],
    "fedavg": [42.65, 51.78, 44.31, 23.94, 31.97, 52.75, 51.64],
    "fedavg_ft": [87.65, 73.68, 82.04, 79.34, 55.44, 71.92, 72.41],
    "fedprox": [39.92, 50.99, 21.93, 20.17, 28.52, 52.33, 18.89],
    "fedprox_ft": [85.81, 72.75, 75.41, 78.52, 55.09, 71.21, 53.54],
    "scaffold": [37.72, 47.33, 33.79, 20.32, 22.52, 51.31, 17.65],
    "scaffold_ft": [86.35, 68.23, 78.24, 78.88, 44.34, 71.49, 52.11],
    "fedmtl": [80.46, 58.31, 76.53, 71.47, 41.25, 71.20, 54.11],
    "perfedavg": [82.27, 67.20, 67.36, 72.05, 52.49, 68.45, 71.51],
    "lg_fedavg": [84.14, 63.02, 77.48, 72.44, 38.76, 70.37, 62.08],
    "l2gd": [81.04, 59.98, 71.96, 72.13, 42.84, 70.67, 66.18],
    "apfl": [83.77, 72.29, 82.39, 78.20, 55.44, 69.87, 70.74],
    "ditto": [85.39, 70.34, 80.36, 78.91, 56.34, 71.04, 68.28],
    "fedper": [87.13, 73.84, 81.73, 76.00, 55.68, 72.12, 76.91],
    "fedrep": [87.70, 75.68, 83.27, 79.15, 56.10, 72.41, 78.56],
}


def pattern_checks(acc: dict[str, float]) -> list[tuple[str, bool]]:
    """Issue 4's ordering: personalised and +FT methods clearly (≥ 5 points) beat the global models;
    FedRep is best or within 2 points."""
    checks: list[tuple[str, bool]] = []
    glob = {m: acc[m] for m in GLOBAL_MODELS if m in acc}
    if glob:
        top_global = max(glob.values())
        for m, v in acc.items():
            if m not in GLOBAL_MODELS:
                checks.append(
                    (
                        f"{LABEL[m]} beats the global models by ≥ 5 points ({v:.2f} vs {top_global:.2f})",
                        v >= top_global + 5,
                    )
                )
    if "fedrep" in acc:
        best = max(acc.values())
        checks.append(
            (f"FedRep is best or within 2 points ({acc['fedrep']:.2f} vs best {best:.2f})", acc["fedrep"] >= best - 2)
        )
    return checks


def experiment_for(column: str, runs_dir: Path = Path("runs")) -> Experiment:
    """The experiment file of one column (``digits`` or one of ``REAL_COLUMNS``)."""
    name = "table1_digits.yaml" if column == "digits" else f"table1_{column}.yaml"
    return load_experiment(CONFIGS / "experiments" / name, runs_dir=runs_dir)


def main(argv: list[str] | None = None) -> int:
    names = [m for _, m in METHODS]
    parser = argparse.ArgumentParser(prog="python -m experiments table1", description=__doc__)
    parser.add_argument("--dataset", choices=["digits", "real"], default="digits")
    parser.add_argument("--columns", nargs="+", default=None, help=f"real columns (default all): {REAL_COLUMNS}")
    parser.add_argument("--methods", nargs="+", default=names, choices=names, metavar="METHOD", help=f"{names}")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the files', 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the configs' T)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (worker processes)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("results/table1"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train.py arguments, last")
    args = parser.parse_args(argv)

    if args.dataset == "digits":
        if args.columns not in (None, ["digits"]):
            parser.error("--dataset digits has the single column digits")
        columns = ["digits"]
    else:
        columns = args.columns or REAL_COLUMNS
        unknown = [c for c in columns if c not in REAL_COLUMNS]
        if unknown:
            parser.error(f"unknown columns {unknown}; known: {REAL_COLUMNS}")

    acc: dict[str, dict[str, list[float]]] = {}
    records: list[dict[str, Any]] = []
    for column in columns:
        try:
            experiment = experiment_for(column, args.runs_dir).select("method", args.methods)
            if args.seeds is not None:
                experiment = experiment.with_seeds(range(args.seeds))
            extra = list(args.extra)
            if args.rounds is not None:
                experiment = dataclasses.replace(
                    experiment, name=f"{experiment.name}-r{args.rounds}", description=f"{args.rounds} rounds (--rounds)"
                )
                extra.append(f"--trainer.max_steps={args.rounds}")
            result = run_experiment(experiment, extra, jobs=args.jobs, report_dir=args.out / column)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if result.code:
            return result.code
        acc[column] = {m: [] for m in args.methods}
        for r in result.results:
            acc[column][r.axes["method"]].append(100 * reported_figure(r.summary))  # in %; a "+FT" row: final_ft
        records += results_records(result.results)

    mean = {c: {m: statistics.fmean(v) for m, v in acc[c].items()} for c in columns}
    seeds = max(len(v) for c in columns for v in acc[c].values())
    rows = []
    for method in args.methods:
        row: list[Any] = [LABEL[method]]
        for c in columns:
            values = acc[c][method]
            row.append(f"{mean[c][method]:.2f}" + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""))
            if c in REAL_COLUMNS:
                row.append(f"{PAPER[method][REAL_COLUMNS.index(c)]:.2f}")
        rows.append(row)
    headers = ["method"]
    for c in columns:
        headers += [f"{c} (%)"] + ([f"{c} paper"] if c in REAL_COLUMNS else [])

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "table1.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(headers)
        writer.writerows(rows)
    print()
    print(f"FedRep Table 1 ({args.dataset}): mean client test accuracy (%), last 10 rounds, "
          f"mean ± std over {seeds} seed(s)")  # fmt: skip
    print(format_table(headers, rows))
    for c in columns:
        print()
        print(f"pattern checks, {c} (on the means over seeds):")
        for text, ok in pattern_checks(mean[c]):
            print(f"[{'ok' if ok else 'FAIL'}] {text}")
        ref = [PAPER[m][REAL_COLUMNS.index(c)] for m in args.methods] if c in REAL_COLUMNS else None
        bar_chart(
            args.out / f"table1_{c}.png",
            [LABEL[m] for m in args.methods],
            [mean[c][m] for m in args.methods],
            "mean client test accuracy (%)",
            f"Table 1, {c}: last-10-round average, mean over {seeds} seed(s)",
            reference=ref,
        )
    print()
    print(f"csv: {args.out / 'table1.csv'}")
    path = write_results(records, args.out)
    print(f"results: {path}")
    return 0
