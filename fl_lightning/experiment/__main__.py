"""``python -m fl_lightning.experiment run FILE.yaml | compare RUN_DIRS... | compare --wandb PROJECT --group G``.

run      expand an experiment file into runs (methods × datasets × seeds × overrides), check every run with
         train.py's parser, run them (skipping finished ones, resuming unfinished ones), then print the table
         and write runs/<name>/results.json and PNGs.
compare  the same table and plots from any finished run dirs (any mix of experiments), or from a W&B group, into
         results/compare/<a name made of its inputs>/ (or --out DIR); a folder that holds another comparison is
         never overwritten silently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from fl_lightning.errors import ConfigError
from fl_lightning.experiment.report import FORMATS


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _jobs(text: str) -> int | str:
    """``--jobs``: a number, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


class OneLineParser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}; fix: see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m fl_lightning.experiment", description=__doc__,
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
    run.add_argument("--jobs", type=_jobs, default=1,
                     help="runs at once, as worker processes (default 1: in process); auto: as many as the GPU "
                     "memory a first job measured holds (fl_lightning.experiment.gpu_share)")  # fmt: skip
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
    compare.add_argument("--out", type=Path, default=None,
                         help="folder for results.json, PNGs (default results/compare/<name of the inputs>)")
    compare.add_argument("--overwrite", action="store_true", help="replace a comparison of other inputs in --out")
    table_options(compare, "last10")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    import yaml

    from fl_lightning.experiment.runner import run_experiment
    from fl_lightning.experiment.spec import ExperimentError, figure_problem, load_experiment, override

    experiment = load_experiment(args.file, runs_dir=args.runs_dir)
    for metric in args.metric or ():  # checked before any run, as the file's report.metrics are
        problem = figure_problem(metric)
        if problem:
            raise ExperimentError(f"--metric {problem}")
    if args.curve is not None and "/" not in args.curve:
        raise ExperimentError(f"--curve: expected a metrics.csv column such as val/acc_mean, got {args.curve!r}")
    unknown = [b for b in args.by or () if b not in (*experiment.axes, "experiment")]
    if unknown:
        raise ExperimentError(f"--by {unknown[0]}: not an axis of {args.file}; fix: one of "
                              f"{', '.join([*experiment.axes, 'experiment'])}")  # fmt: skip
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
        inputs = [f"wandb:{args.wandb}/{args.group}"]
        try:
            results = from_wandb(args.wandb, args.group, curve_keys=[args.curve or "val/acc_mean"])
        except ConfigError:
            raise
        except Exception as exc:  # no network, no login, no such project: W&B raises many kinds
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise ConfigError(
                f"compare --wandb {args.wandb}: W&B cannot be read ({type(exc).__name__}: {reason}); fix: check the "
                "network and `wandb login`, or compare run dirs (offline runs: compare runs/<name> directly)"
            ) from None
    else:
        if not args.run_dirs:
            raise ConfigError("compare: give run dirs (or folders holding them), or --wandb PROJECT --group G")
        inputs = [str(p) for p in args.run_dirs]
        results = from_run_dirs(args.run_dirs)
    check_table_options(results, args.metric, args.by)
    out = args.out or Path("results") / "compare" / compare_name(inputs)
    claim_out_dir(out, inputs, args.overwrite)
    text, path, plots = write_report(results, out, args.by, args.metric, args.format, args.curve)
    print(text)
    print()
    for p in plots:
        print(f"plot: {p}")
    print(f"results: {path}")
    return 0


def compare_name(inputs: Sequence[str]) -> str:
    """A folder name for a comparison: its inputs' names (shortened) and a hash of all of them."""
    names = [Path(i.rstrip("/")).name or "root" for i in inputs]
    stem = re.sub(r"[^A-Za-z0-9_.+=-]+", "-", "+".join(names)).strip("-")[:60] or "compare"
    digest = hashlib.sha1("\n".join(sorted(str(Path(i).resolve()) if not i.startswith("wandb:") else i
                                            for i in inputs)).encode()).hexdigest()[:8]  # fmt: skip
    return f"{stem}-{digest}"


def claim_out_dir(out: Path, inputs: Sequence[str], overwrite: bool) -> None:
    """``out`` holds this comparison (``compare.json`` names its inputs): a folder that holds another comparison,
    or other results, is refused unless ``--overwrite``."""
    record = out / "compare.json"
    mine = sorted(str(Path(i).resolve()) if not i.startswith("wandb:") else i for i in inputs)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"compare --out {out} is a file; fix: pick a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        try:
            theirs = json.loads(record.read_text()).get("inputs")
        except (OSError, ValueError, AttributeError):
            theirs = None
        if theirs != mine:
            what = f"a comparison of {', '.join(theirs)[:120]}" if theirs else "other files"
            raise ConfigError(f"compare --out {out} holds {what}; fix: pick another --out, or add --overwrite to "
                              "replace it")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"inputs": mine}, indent=1) + "\n")


def check_table_options(results: Sequence, metrics: Sequence[str] | None, by: Sequence[str] | None) -> None:
    """A ``--metric`` that no run reports, or a ``--by`` that no run has, would print a table of dashes."""
    known = sorted({k for r in results for k, v in r.summary.items() if isinstance(v, (int, float))})
    for m in metrics or ():
        if not any(m in r.summary for r in results):
            raise ConfigError(f"--metric {m}: no run reports it; fix: one of {', '.join(known)}")
    axes = sorted({a for r in results for a in r.axes} | {"experiment", "seed"})
    for b in by or ():
        if b not in axes:
            raise ConfigError(f"--by {b}: no run has this axis; fix: one of {', '.join(axes)}")


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
