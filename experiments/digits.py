"""FedRep Table 1's pattern on the bundled digits split (20 clients, 2 classes each, 20% participation).

``python -m experiments digits [--seeds N] [--rounds T] [--jobs N]`` runs six methods of the experiment file
``configs/experiments/table1_digits.yaml`` (FedAvg, FedAvg+FT, FedRep, FedPer, LG-FedAvg and Local Only × 3 seeds)
with the generic runner (``python -m fl_lightning.experiment run``; the run dirs are the Table 1 experiment's,
``runs/table1-digits/``, so finished runs of either command are reused), prints mean ± std over seeds and the checks
of issue 2 on the means (FedRep best or within 2 points; ≥ 15 points above FedAvg; FedAvg+FT recovers most of the
gap), and writes the report (``results.json``, curves, per-client accuracies) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from experiments import ROOT
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.runner import run_experiment
from fl_lightning.experiment.spec import load_experiment
from fl_lightning.results import reported_figure

EXPERIMENT = ROOT / "configs" / "experiments" / "table1_digits.yaml"
LABELS = {
    "fedavg": "FedAvg",
    "fedavg_ft": "FedAvg+FT",
    "fedrep": "FedRep",
    "fedper": "FedPer",
    "lg_fedavg": "LG-FedAvg",
    "local": "Local Only",
}


def pattern_checks(acc: dict[str, float]) -> list[tuple[str, bool]]:
    """Issue 2's checks on the mean accuracies (fractions), keyed by display name."""
    best = max(acc.values())
    gap = acc["FedRep"] - acc["FedAvg"]
    recovered = (acc["FedAvg+FT"] - acc["FedAvg"]) / gap if gap > 0 else float("nan")
    return [
        (
            f"FedRep is best or within 2 points of the best ({100 * acc['FedRep']:.2f} vs {100 * best:.2f})",
            acc["FedRep"] >= best - 0.02,
        ),
        (f"FedRep is ≥ 15 points above FedAvg's global model (+{100 * gap:.1f})", gap >= 0.15),
        (f"FedAvg+FT recovers most of that gap ({100 * recovered:.0f}%)", recovered > 0.5),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments digits", description=__doc__)
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the file's, 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the configs', 100)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("results/digits"))
    args = parser.parse_args(argv)

    try:
        experiment = load_experiment(EXPERIMENT, runs_dir=args.runs_dir).select("method", list(LABELS))
        if args.seeds is not None:
            experiment = experiment.with_seeds(range(args.seeds))
        extra = []
        if args.rounds is not None:  # other rounds are another experiment (its own run dirs and W&B group)
            experiment = dataclasses.replace(
                experiment, name=f"{experiment.name}-r{args.rounds}", description=f"{args.rounds} rounds (--rounds)"
            )
            extra.append(f"--trainer.max_steps={args.rounds}")
        result = run_experiment(experiment, extra, jobs=args.jobs, report_dir=args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.code:
        return result.code
    per_method: dict[str, list[float]] = {}
    for r in result.results:
        per_method.setdefault(LABELS[r.axes["method"]], []).append(reported_figure(r.summary))  # "+FT": final_ft
    acc = {m: statistics.fmean(v) for m, v in per_method.items()}
    for text, ok in pattern_checks(acc):
        print(f"[{'ok' if ok else 'FAIL'}] {text}")
    print(f"results: {result.results_path}")
    return 0
