"""``python -m fl_lightning.experiment run FILE.yaml | compare RUN_DIRS... | compare --wandb PROJECT --group G``.

run      expand an experiment file into runs (methods × datasets × seeds × overrides), check every run with
         train.py's parser, run them (skipping finished ones, resuming unfinished ones), then print the table
         and write runs/<name>/results.json and PNGs.
compare  the same table and plots from any finished run dirs (any mix of experiments), or from a W&B group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fl_lightning.errors import ConfigError
from fl_lightning.experiment.report import FORMATS


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fl_lightning.experiment", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    def table_options(p: argparse.ArgumentParser, metric_default: str | None) -> None:
        p.add_argument("--by", type=_list, default=None, help="group by these axes (default: every axis but seed)")
        p.add_argument("--metric", type=_list, default=metric_default,
                       help="summary figure(s) to average, comma-separated (default last10)")  # fmt: skip
        p.add_argument("--format", choices=FORMATS, default="md", help="table format (default md)")
        p.add_argument("--curve", default=None, help="metric of the curve plot (default val/acc_mean)")

    run = sub.add_parser("run", help="run an experiment file")
    run.add_argument("file", type=Path)
    run.add_argument("--dry-run", action="store_true", help="list the runs, their state and commands; run nothing")
    run.add_argument("--jobs", type=int, default=1, help="runs at once, as worker processes (default 1: in process)")
    run.add_argument("--batch-runs", type=int, default=None, metavar="K",
                     help="at most K runs that share an algorithm class and network train as one batched job "
                     "(default: the file's batch_runs, else all of them; 1: one run at a time)")  # fmt: skip
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="extra dotted override for every run (after the file's own)")  # fmt: skip
    run.add_argument("--runs-dir", type=Path, default=None, help="root of the run dirs (default: the file's, runs/)")
    run.add_argument("--overwrite", action="store_true", help="rerun every run from scratch, finished ones too")
    table_options(run, None)

    compare = sub.add_parser("compare", help="table and plots from finished runs")
    compare.add_argument("run_dirs", nargs="*", type=Path, help="run dirs or folders holding them")
    compare.add_argument("--wandb", metavar="PROJECT", default=None, help="read a W&B group instead (entity/project)")
    compare.add_argument("--group", default=None, help="the W&B group (= the experiment name)")
    compare.add_argument("--out", type=Path, default=Path("results/compare"), help="folder for results.json, PNGs")
    table_options(compare, "last10")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    import yaml

    from fl_lightning.experiment.runner import run_experiment
    from fl_lightning.experiment.spec import ExperimentError, load_experiment, override

    experiment = load_experiment(args.file, runs_dir=args.runs_dir)
    extra = []
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExperimentError(f"--set {item}: expected KEY=VALUE")
        extra.append(override(key, yaml.safe_load(value)))
    result = run_experiment(
        experiment,
        extra,
        jobs=args.jobs,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        batch_runs=args.batch_runs,
        metrics=args.metric,
        by=args.by,
        fmt=args.format,
        curve=args.curve,
    )
    if result.results_path is not None:
        print(f"results: {result.results_path}")
    return result.code


def cmd_compare(args: argparse.Namespace) -> int:
    from fl_lightning.experiment.collect import from_run_dirs, from_wandb
    from fl_lightning.experiment.report import write_report

    if args.wandb:
        if not args.group:
            raise ConfigError("compare --wandb PROJECT needs --group G (the experiment name)")
        if args.run_dirs:
            raise ConfigError("compare: give run dirs or --wandb, not both")
        results = from_wandb(args.wandb, args.group, curve_keys=[args.curve or "val/acc_mean"])
    else:
        if not args.run_dirs:
            raise ConfigError("compare: give run dirs (or folders holding them), or --wandb PROJECT --group G")
        results = from_run_dirs(args.run_dirs)
    text, path, plots = write_report(results, args.out, args.by, args.metric, args.format, args.curve)
    print(text)
    print()
    for p in plots:
        print(f"plot: {p}")
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return cmd_run(args) if args.command == "run" else cmd_compare(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
