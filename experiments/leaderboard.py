"""The leaderboard (issue 44): every method of ``configs/experiments/leaderboard_digits.yaml`` tuned on a validation
split (with the grid extension of ``fl_lightning/experiment/tuning.py``), then 5 fresh seeds on the test split.

``make leaderboard`` = ``python -m experiments leaderboard [--jobs N] [--check] [--no-timing]`` runs the experiment
with the generic runner (finished runs under ``runs/leaderboard-digits/`` are reused), then writes

* ``docs/leaderboard.csv``: per method, the mean and sample std over the seeds of the reported accuracy (``last10``;
  ``final_ft`` for a "+FT" method), of the worst 10 % of clients' accuracy at the end, and the bytes a run uploads,
  rounded to 6 digits. Training is seeded and deterministic on one machine, so a rerun writes the same file;
  ``--check`` compares instead of writing and exits 1 on a difference;
* ``docs/leaderboard.md``: that table, the CPU seconds of one run per method (seed 0 trained again in its own
  process, user + system time including start-up: the only figure that changes between reruns), the chosen
  learning rate, and the ordering checks: which pairs of methods differ by more than two standard deviations;
* ``docs/figures/leaderboard/leaderboard.png`` (the accuracies with their seed spread) and ``results.json`` (every
  run's summary, from the runner's report), plus the runner's curves.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import ROOT
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.runner import run_experiment
from fl_lightning.experiment.spec import load_experiment
from fl_lightning.results import FINETUNED, reported_figure

EXPERIMENT = ROOT / "configs" / "experiments" / "leaderboard_digits.yaml"
LABELS = {
    "local": "Local Only",
    "fedavg": "FedAvg",
    "fedavg_ft": "FedAvg+FT",
    "fedper": "FedPer",
    "fedrep": "FedRep",
    "lg_fedavg": "LG-FedAvg",
    "ditto": "Ditto",
}
COLUMNS = ["method", "acc_mean", "acc_std", "worst10_mean", "worst10_std", "upload_bytes", "seeds"]


def figure(summary: dict, key: str) -> float:
    """``key`` of a run, its "+FT" value where the run fine-tuned (``final_worst10`` -> ``final_ft_worst10``)."""
    return reported_figure(summary, key)


def rows_of(results: list, order: list[str]) -> list[dict]:
    """One row per method, in ``order`` (the file's): mean and sample std over seeds, upload bytes per run."""
    by: dict[str, list[dict]] = {}
    for r in results:
        by.setdefault(r.axes["method"], []).append(r.summary)
    rows = []
    for method, summaries in sorted(by.items(), key=lambda kv: order.index(kv[0])):
        acc = [figure(s, "last10") for s in summaries]
        worst = [figure(s, "final_worst10") for s in summaries]
        uploads = {float(s["upload_bytes"]) for s in summaries}
        rows.append({
            "method": method,
            "acc_mean": statistics.fmean(acc),
            "acc_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
            "worst10_mean": statistics.fmean(worst),
            "worst10_std": statistics.stdev(worst) if len(worst) > 1 else 0.0,
            "upload_bytes": statistics.fmean(uploads),
            "seeds": len(summaries),
            "finetuned": any(FINETUNED in s for s in summaries),
        })  # fmt: skip
    return rows


def csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([r["method"], *(f"{r[k]:.6f}" for k in COLUMNS[1:5]), f"{r['upload_bytes']:.0f}", r["seeds"]])
    return out.getvalue()


def separated(a: dict, b: dict) -> bool:
    """The gap of the means exceeds two standard deviations of the seeds (the larger of the two methods')."""
    return abs(a["acc_mean"] - b["acc_mean"]) > 2 * max(a["acc_std"], b["acc_std"])


def ordering(rows: list[dict]) -> list[str]:
    """Every pair of methods, best first: separated (gap > 2 std) or tied."""
    ranked = sorted(rows, key=lambda r: -r["acc_mean"])
    lines = []
    for a, b in itertools.combinations(ranked, 2):
        gap = 100 * (a["acc_mean"] - b["acc_mean"])
        two_std = 200 * max(a["acc_std"], b["acc_std"])
        verdict = ">" if separated(a, b) else "≈"
        lines.append(f"{LABELS[a['method']]} {verdict} {LABELS[b['method']]} (gap {gap:.2f}, 2 std {two_std:.2f})")
    return lines


def training_args(run_args: list[str]) -> list[str]:
    """A run's ``train.py`` arguments without its run dir (flag and value) and its W&B settings."""
    args, skip = [], False
    for a in run_args:
        if skip or a.startswith("--wandb"):
            skip = False
            continue
        if a == "--run_dir":
            skip = True
            continue
        args.append(a)
    return args


def cpu_seconds(run_args: list[str]) -> float:
    """User + system CPU seconds of ``train.py run_args`` in a child process (its own run dir, no W&B)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(run_args)
        env = {**os.environ, "WANDB_MODE": "disabled"}
        cmd = [sys.executable, str(ROOT / "train.py"), *args, "--run_dir", tmp, "--overwrite", "true"]
        subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = sorted(rows, key=lambda r: -r["acc_mean"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [LABELS[r["method"]] for r in ranked]
    ax.bar(names, [100 * r["acc_mean"] for r in ranked], yerr=[200 * r["acc_std"] for r in ranked], capsize=4,
           color="tab:blue", alpha=0.8, label="accuracy (mean ± 2 std over seeds)")  # fmt: skip
    worst = [100 * r["worst10_mean"] for r in ranked]
    ax.scatter(names, worst, color="tab:red", zorder=3, label="worst 10 % of clients")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("digits, 50 clients, 4 label permutations (docs/leaderboard.md)", fontsize=9)
    fig.autofmt_xdate(rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: list[dict], chosen: dict[str, str], cpu: dict[str, float], checks: list[str]) -> str:
    head = ("| method | chosen (tuned) | accuracy (%, mean ± std) | worst 10 % (%, mean ± std) | uploaded per run (MB) "
            "| CPU s per run | seeds |")  # fmt: skip
    lines = [head, "|---|---|--:|--:|--:|--:|--:|"]
    for r in sorted(rows, key=lambda r: -r["acc_mean"]):
        acc = f"{100 * r['acc_mean']:.2f} ± {100 * r['acc_std']:.2f}" + (" (+FT)" if r["finetuned"] else "")
        worst = f"{100 * r['worst10_mean']:.2f} ± {100 * r['worst10_std']:.2f}"
        seconds = f"{cpu[r['method']]:.1f}" if r["method"] in cpu else "-"
        lines.append(f"| {LABELS[r['method']]} | {chosen.get(r['method'], '-')} | {acc} | {worst} | "
                     f"{r['upload_bytes'] / 1e6:.2f} | {seconds} | {r['seeds']} |")  # fmt: skip
    return "\n".join(lines + ["", "Pairs of methods (gap of the means against two standard deviations of the seeds, "
                              "the larger method's), best first:", ""] + [f"- {c}" for c in checks]) + "\n"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments leaderboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("results/leaderboard"))
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    parser.add_argument("--check", action="store_true", help="compare with the committed CSV instead of writing")
    parser.add_argument("--no-timing", action="store_true", help="skip the CPU-seconds runs (the column shows -)")
    parser.add_argument("--experiment", type=Path, default=EXPERIMENT)
    args = parser.parse_args(argv)
    try:
        experiment = load_experiment(args.experiment, runs_dir=args.runs_dir)
        result = run_experiment(experiment, jobs=args.jobs, report_dir=args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.code:
        return result.code
    rows = rows_of(result.results, [p.label for p in experiment.axes["method"]])
    text = csv_text(rows)
    csv_path = args.docs / "leaderboard.csv"
    if args.check:
        same = csv_path.is_file() and csv_path.read_text() == text
        print(f"{csv_path}: {'identical' if same else 'DIFFERENT'}")
        if not same:
            print(text)
        return 0 if same else 1
    tune = json.loads((experiment.out_dir / "tune.json").read_text())
    chosen = {}
    for record in tune:
        flag = "".join(f" [edge: {e}]" for e in record.get("edges", []))
        chosen[record["axes"]["method"]] = f"{record['chosen']}{flag} ({record['trials']} trials)"
    cpu: dict[str, float] = {}
    if not args.no_timing:
        for o in result.outcomes:
            method = next((p.label for p in o.run.points if p.axis == "method"), None)
            if method is not None and method not in cpu and o.run.seed == 0 and "tune" not in o.run.run_dir.parts:
                cpu[method] = cpu_seconds(o.run.args())
    checks = ordering(rows)
    figures = args.docs / "figures" / "leaderboard"
    figures.mkdir(parents=True, exist_ok=True)
    csv_path.write_text(text)
    plot(rows, figures / "leaderboard.png")
    for p in [result.results_path, *result.plots]:
        if p is not None and Path(p).is_file():
            shutil.copy(p, figures / Path(p).name)
    table = markdown(rows, chosen, cpu, checks)
    (args.out / "leaderboard_table.md").write_text(table)
    write_between_markers(args.docs / "leaderboard.md", table)
    print(table)
    return 0


BEGIN, END = "<!-- leaderboard: begin (written by python -m experiments leaderboard) -->", "<!-- leaderboard: end -->"


def write_between_markers(path: Path, table: str) -> None:
    """Put ``table`` between the markers of ``path`` (the prose around them stays); a new file gets only them."""
    text = path.read_text() if path.is_file() else f"# Leaderboard\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = f"{text.rstrip()}\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


if __name__ == "__main__":
    sys.exit(main())
