"""``python -m fl_lightning.experiment.run_axis [train.py args…] --seeds 0,1,2 | --runs FILE.json``: one batched job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fl_lightning.errors import ConfigError

USAGE = """\
usage: python -m fl_lightning.experiment.run_axis --config CONFIG.yaml [--config MORE.yaml] [--key VALUE ...]
           --seeds 0,1,2
       python -m fl_lightning.experiment.run_axis --runs RUNS.json

Trains several train.py runs as one batched job (their clients of each round trained together); every run writes
its own run dir exactly as train.py does.

  --seeds S1,S2,...   one run per seed (seed_everything), in <run_dir>/s<seed> (default run_dir: runs/<configs>)
  --runs FILE.json    a JSON list of train.py argument lists, one per run (or of {"args": [...], "name": ...,
                      "log": PATH} objects: each run's console output then goes to its log)
  --ckpt_path last    resume every run from its last checkpoint (a batched job is its runs' checkpoints)
"""


def seed_runs(args: list[str], seeds: list[int]) -> list[list[str]]:
    """``train.py args`` once per seed, each with its own run dir ``<run_dir>/s<seed>``."""
    rest, run_dir, i = [], None, 0
    while i < len(args):
        if args[i] == "--run_dir" and i + 1 < len(args):
            run_dir, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--run_dir="):
            run_dir = args[i].split("=", 1)[1]
        else:
            rest.append(args[i])
        i += 1
    if run_dir is None:
        configs = [rest[j + 1] for j, a in enumerate(rest[:-1]) if a == "--config"]
        run_dir = str(Path("runs") / ("_".join(Path(c).stem for c in configs) or "run"))
    return [[*rest, "--seed_everything", str(s), "--run_dir", str(Path(run_dir) / f"s{s}")] for s in seeds]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args in (["-h"], ["--help"]):
        print(USAGE, end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    from fl_lightning.errors import one_line
    from fl_lightning.experiment.run_axis.driver import BatchedRuns

    try:
        names = logs = None
        if "--runs" in args:
            j = args.index("--runs")
            if j + 1 >= len(args):
                raise ConfigError("--runs: expected a JSON file (a list of train.py argument lists)")
            path = Path(args[j + 1])
            if not path.is_file():
                raise ConfigError(f"--runs {path}: no such file")
            try:
                runs = json.loads(path.read_text())
            except ValueError as exc:  # not JSON, or not text
                raise ConfigError(f"--runs {path}: not JSON ({one_line(exc)})") from None
            if isinstance(runs, list) and runs and all(isinstance(r, dict) and "args" in r for r in runs):
                names = [str(r.get("name", f"run {i}")) for i, r in enumerate(runs)]
                logs = [r["log"] for r in runs] if all("log" in r for r in runs) else None
                runs = [r["args"] for r in runs]
            if not isinstance(runs, list) or not all(isinstance(r, list) for r in runs):
                raise ConfigError(
                    f"--runs {path}: expected a JSON list of argument lists (or of {{args, name, log}} objects)"
                )
        elif "--seeds" in args:
            j = args.index("--seeds")
            text = args[j + 1] if j + 1 < len(args) else ""
            try:
                seeds = [int(s) for s in text.split(",") if s.strip()]
            except ValueError:
                raise ConfigError(f"--seeds {text!r}: expected comma-separated integers") from None
            if not seeds:
                raise ConfigError("--seeds: expected comma-separated integers")
            twice = sorted({s for s in seeds if seeds.count(s) > 1})
            if twice:
                raise ConfigError(f"--seeds {text}: seed {twice[0]} is given twice (each seed is one run with its own "
                                  "run dir <run_dir>/s<seed>); give each seed once")  # fmt: skip
            runs = seed_runs(args[:j] + args[j + 2 :], seeds)
        else:
            raise ConfigError("give --seeds S1,S2,... or --runs FILE.json")
        import torch

        torch.set_float32_matmul_precision("high")
        outcomes = BatchedRuns(runs, names, logs=logs).run()
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    if outcomes and all(o.refused for o in outcomes):  # refused before any run wrote anything: as train.py, exit 2
        errors = list(dict.fromkeys(o.error for o in outcomes))
        if len(errors) == 1:  # the same refusal for every run (they share their config but for the seed)
            print(f"error: {errors[0]}", file=sys.stderr)
        else:
            for o, name in zip(outcomes, names or [f"run {i}" for i in range(len(outcomes))]):
                print(f"error: {name}: {o.error}", file=sys.stderr)
        return 2
    failed = [o for o in outcomes if o.status != "done"]
    for o in outcomes:
        print(f"[{o.status}] {' '.join(o.args)}" + (f": {o.error}" if o.error else ""))
    if any(o.status == "interrupted" for o in outcomes):
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
