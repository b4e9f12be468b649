"""Run the grid of an experiment: skip finished runs, resume unfinished ones, one log per run.

Every run is ``python train.py ARGS`` (:meth:`RunSpec.command`), executed in this process one after the other
(``jobs=1``) or as worker processes (``jobs>1``; on a GPU machine worker ``k`` sees GPU ``k mod #GPUs``;
``jobs="auto"``: as many at once as the GPU memory a first job measured holds, ``gpu_share``). Runs whose
resolved configs differ only in the seed (and what a resume may change), one process per run, train as one
batched job of the run axis (``fl_lightning.experiment.run_axis``: in this
process with ``jobs=1``, a child process per job with ``jobs>1``), at most ``batch_runs`` at a time
(``--batch-runs K`` or ``batch_runs: K``; 1 turns it off); each run's numbers are those of
the run alone. Its output goes to ``<run_dir>/train.log``; ``<run_dir>/run.json`` records the experiment, the axis
labels and the command. A run dir is

- *finished* when its ``summary.json`` reports ``trainer.max_steps`` rounds: skipped;
- *resumable* when it holds a checkpoint: continued with ``--ckpt_path last`` (also a run killed after its last
  round and before ``summary.json``: the resume writes the summary);
- otherwise started from scratch (``--overwrite`` clears what a run that never checkpointed left behind).

A run dir written with other training arguments is not touched (one line says so; ``--overwrite`` reruns it).
A failing run is reported with its dir and error and the others go on; the exit code is then 1. Ctrl-C stops
the grid (exit 130); the same command later finishes it.

A file whose methods say ``tune`` (``spec.py``) first runs the tuning stage: every grid point × tuning seed on the
validation split, in ``<runs_dir>/<name>/tune/...`` (skipped, resumed and batched like any run); then
:func:`choose` picks each method's point by the mean over tuning seeds of its ``metric`` (``summary.json``), writes
``<runs_dir>/<name>/tune.json`` and the grid runs with the chosen setting and the experiment's own seeds. With
``tune.extend`` a winner on the edge of a numeric axis first grows its grid outward (``tuning.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fl_lightning.experiment.gpu_share import JobLimit
from fl_lightning.experiment.spec import Choice, Experiment, Outcome, RunSpec, TuneRun

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"


# ---- the state of a run dir -------------------------------------------------------------------------------------


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def training_args(args: list[str]) -> list[str]:
    """The arguments that decide what a run computes (the W&B settings are left out)."""
    return [a for a in args if not a.startswith("--wandb.")]


def has_checkpoint(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("*.ckpt"))


def run_state(run: RunSpec, max_steps: int | None) -> str:
    """``finished``, ``resume``, ``partial`` (files but nothing to resume from), ``new`` or ``mismatch``."""
    d = run.run_dir
    meta = read_json(d / "run.json")
    if meta is not None and training_args(meta.get("args", [])) != training_args(run.args()):
        return "mismatch"
    summary = read_json(d / "summary.json")
    if isinstance(summary, dict) and "rounds" in summary and (
        not max_steps or summary["rounds"] >= max_steps or summary.get("stopped_early")
    ):
        return "finished"
    if has_checkpoint(d):
        return "resume"
    if d.exists() and any(p.name not in ("run.json", "train.log") for p in d.iterdir()):
        return "partial"
    return "new"


def clear_run_dir(run_dir: Path, keep: tuple[str, ...] = ("train.log",)) -> None:
    if not run_dir.exists():
        return
    for p in run_dir.iterdir():
        if p.name in keep:
            continue
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


# ---- executing one run --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def output_to(path: Path):
    """Send everything this process prints (Python and C level, stdout and stderr) to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield log
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _finish_wandb() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


@contextlib.contextmanager
def as_train_py():
    """Runs in this process as ``train.py``: ``sys.argv`` is the script alone meanwhile, and Ctrl-C raises
    KeyboardInterrupt again afterwards (Lightning ignores SIGINT after an interrupt)."""
    argv, sys.argv = sys.argv, [str(TRAIN_PY)]
    try:
        yield
    finally:
        sys.argv = argv
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_in_process(args: list[str], log_path: Path) -> tuple[str, str]:
    """``train.py args`` in this process; returns (status, one-line error)."""
    from fl_lightning import cli
    from fl_lightning.errors import one_line

    with as_train_py():
        with output_to(log_path) as log:
            try:
                cli.run(args)
                return "done", ""
            except (KeyboardInterrupt, SystemExit):
                # Lightning turns Ctrl-C during fit into a graceful stop and sys.exit(1)
                print("interrupted", file=log)
                return "interrupted", "interrupted"
            except Exception as exc:
                traceback.print_exc(file=log)
                return "failed", one_line(exc)
            finally:
                with contextlib.suppress(Exception):
                    _finish_wandb()


def train_command() -> list[str]:
    if TRAIN_PY.is_file():
        return [sys.executable, str(TRAIN_PY)]
    return [sys.executable, "-c", "import sys; from fl_lightning.cli import main; sys.exit(main())"]


def last_error_line(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors:
        return errors[-1][len("error:") :].strip()
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")


class Workers:
    """Runs ``train.py`` as child processes, at most ``jobs`` at a time; ``stop()`` interrupts them."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.procs: dict[int, subprocess.Popen] = {}
        self.lock = threading.Lock()
        self.stopping = False
        try:
            import torch

            self.gpus = torch.cuda.device_count()
        except Exception:  # pragma: no cover - torch always imports here
            self.gpus = 0
        self.free_slots = list(range(jobs))

    def env(self, slot: int) -> dict[str, str]:
        env = dict(os.environ)
        if self.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.jobs))
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def run(self, args: list[str], log_path: Path, command: list[str] | None = None) -> tuple[str, str]:
        """``train.py args`` (or ``command + args``) as a child process writing to ``log_path``."""
        with self.lock:
            if self.stopping:
                return "interrupted", "interrupted"
            slot = self.free_slots.pop(0)
        try:
            with open(log_path, "a") as log:
                proc = subprocess.Popen(
                    [*(command or train_command()), *args], stdout=log, stderr=subprocess.STDOUT, env=self.env(slot)
                )
                with self.lock:
                    self.procs[proc.pid] = proc
                code = proc.wait()
                with self.lock:
                    self.procs.pop(proc.pid, None)
        finally:
            with self.lock:
                self.free_slots.append(slot)
        if code == 0:
            return "done", ""
        if self.stopping or code in (130, -signal.SIGINT):
            return "interrupted", "interrupted"
        return "failed", last_error_line(log_path) or f"exit code {code}"

    def stop(self, grace_s: float = 30.0) -> None:
        with self.lock:
            self.stopping = True
            procs = list(self.procs.values())
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()


# ---- the grid -----------------------------------------------------------------------------------------------------


class Progress:
    """A bar over runs on the terminal (stderr), and one line per run."""

    def __init__(self, total: int, stream: TextIO) -> None:
        from tqdm import tqdm

        self.stream = stream
        self.bar = tqdm(total=total, desc="runs", unit="run", file=stream, dynamic_ncols=True, disable=None)

    def line(self, text: str) -> None:
        self.bar.write(text, file=self.stream)

    def advance(self, outcome: Outcome) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(outcome.run.wandb_name, refresh=True)

    def close(self) -> None:
        self.bar.close()


def start_args(run: RunSpec, state: str, overwrite: bool) -> list[str] | None:
    """The arguments to (re)start ``run`` from ``state``, after preparing its dir; ``None``: leave it."""
    if state == "finished" and not overwrite:
        return None
    if overwrite or state in ("partial", "mismatch"):
        clear_run_dir(run.run_dir)
        state = "new"
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "run.json").write_text(json.dumps(run.metadata(), indent=1))
    return run.args() + (["--ckpt_path", "last"] if state == "resume" else [])


def batch_groups(
    todo: list[int], configs: list[dict[str, Any] | None], limit: int | None
) -> list[list[int]]:
    """The positions ``todo`` as jobs, in grid order: runs whose resolved configs have one batch key (their
    identities equal but for the seed: ``run_axis.batching``) and a one-process trainer share a job (at most
    ``limit`` of them; ``limit`` 1 or a config that was not resolved: one run per job). A job's first run is the
    earliest of its runs in the grid."""
    from fl_lightning.experiment.run_axis.batching import batch_key, multi_process

    groups: dict[str, list[int]] = {}
    jobs: list[list[int]] = []
    for i in todo:
        config = configs[i]
        if limit == 1 or config is None or multi_process(config):  # a multi-process trainer trains alone
            jobs.append([i])
            continue
        key = batch_key(config)
        group = groups.get(key)
        if group is None or (limit is not None and len(group) >= limit):
            group = groups[key] = []
            jobs.append(group)
        group.append(i)
    return jobs


#: with ``jobs>1`` a batched job is one child process of the run axis (``python -m fl_lightning.experiment.run_axis
#: --runs FILE``); with ``jobs=1`` it runs in this process (``run_batch_in_process``), as single runs do
BATCH_COMMAND = [sys.executable, "-m", "fl_lightning.experiment.run_axis", "--runs"]


def batch_results(runs: list[RunSpec], results: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(status, one-line error) per run of a finished batched job: done when its summary exists."""
    if any(status == "interrupted" for status, _ in results):
        return [("interrupted", "interrupted")] * len(runs)
    return [
        ("done", "")
        if (r.run_dir / "summary.json").is_file()
        else ("failed", last_error_line(r.run_dir / "train.log") or error or "no summary.json")
        for r, (_, error) in zip(runs, results)
    ]


def run_batch_in_process(
    runs: list[RunSpec], arg_lists: list[list[str]], configs: list[dict[str, Any] | None]
) -> list[tuple[str, str]]:
    """``runs`` as one batched job in this process (``run_axis.BatchedRuns``, each run printing to its own
    ``train.log``): no second interpreter to start and no second parse of configs the runner already resolved
    and grouped (``batch_groups``)."""
    from fl_lightning.experiment.run_axis.driver import BatchedRuns

    known = None if any(c is None for c in configs) else configs
    with as_train_py():
        outcomes = BatchedRuns(arg_lists, [r.wandb_name for r in runs], logs=[r.run_dir / "train.log" for r in runs],
                               configs=known).run()  # fmt: skip
    return batch_results(runs, [(o.status, o.error) for o in outcomes])


def run_batch(workers: Workers, runs: list[RunSpec], arg_lists: list[list[str]], folder: Path) -> list[tuple[str, str]]:
    """``runs`` as one batched job in a child process, each printing to its own ``train.log``; (status, one-line
    error) per run: done when its summary exists. The job's ``--runs`` file and its own log go to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / f"{runs[0].wandb_name}.json"
    jobs = [{"args": a, "name": r.wandb_name, "log": str(r.run_dir / "train.log")} for r, a in zip(runs, arg_lists)]
    spec.write_text(json.dumps(jobs, indent=1))
    status, error = workers.run([str(spec)], spec.with_suffix(".log"), BATCH_COMMAND)
    return batch_results(runs, [(status, error)] * len(runs))


def execute(
    experiment: Experiment,
    runs: list[RunSpec],
    max_steps: dict[str, int | None],
    jobs: int | str = 1,
    overwrite: bool = False,
    stream: TextIO | None = None,
    configs: dict[str, dict[str, Any]] | None = None,
    batch_runs: int | None = None,
) -> list[Outcome]:
    """Run (or skip) every run of the grid; returns one :class:`Outcome` per run, in grid order. ``configs`` (run
    dir → resolved config) lets runs that can share a process train as batched jobs of at most ``batch_runs``."""
    stream = stream or sys.stderr
    progress = Progress(len(runs), stream)
    outcomes: dict[int, Outcome] = {}
    todo: dict[int, tuple[list[str], str]] = {}
    for i, run in enumerate(runs):
        state = run_state(run, max_steps.get(str(run.run_dir)))
        if state == "mismatch" and not overwrite:
            outcomes[i] = Outcome(
                run, "failed", f"{run.run_dir} holds a run with other training arguments (run.json); "
                "delete it or pass --overwrite"
            )  # fmt: skip
            progress.line(f"[fail] {run.wandb_name}: {outcomes[i].error}")
            progress.advance(outcomes[i])
            continue
        args = start_args(run, state, overwrite)
        if args is None:
            outcomes[i] = Outcome(run, "skipped")
            progress.advance(outcomes[i])
            continue
        todo[i] = (args, state)
    skipped = sum(o.status == "skipped" for o in outcomes.values())
    if skipped:
        progress.line(f"{skipped} finished run(s) skipped")
    resolved = [None if configs is None else configs.get(str(run.run_dir)) for run in runs]
    units = batch_groups(list(todo), resolved, batch_runs)
    batches = experiment.out_dir / "batches"  # each batched job's --runs file and its own log

    def report(i: int, status: str, error: str, seconds: float) -> None:
        run = runs[i]
        if status == "done" and not (run.run_dir / "summary.json").is_file():  # [done] means summary.json exists
            status, error = "failed", "stopped before its summary.json (the same command resumes it)"
        outcomes[i] = Outcome(run, status, error, seconds)
        if status == "done":
            progress.line(f"[done] {run.wandb_name} ({seconds:.0f} s)")
        elif status == "failed":
            progress.line(f"[fail] {run.wandb_name}: {error} (dir {run.run_dir}, log {run.run_dir / 'train.log'})")
        progress.advance(outcomes[i])

    def announce(unit: list[int]) -> None:
        for i in unit:
            verb = "resume" if todo[i][1] == "resume" else "start"
            progress.line(f"[{verb}] {runs[i].wandb_name} -> {runs[i].run_dir}")
        if len(unit) > 1:
            progress.line(f"[batch] {', '.join(runs[i].wandb_name for i in unit)}: one job ({len(unit)} runs)")
        for i in unit:
            _log_header(runs[i].run_dir / "train.log", runs[i], todo[i][0])

    interrupted = False
    limit = JobLimit(jobs)  # a number, or "auto": one job, then as many as the GPU memory it measured holds
    try:
        if limit.in_process:
            for unit in units:
                announce(unit)
                start = time.perf_counter()
                if len(unit) == 1:
                    results = [run_in_process(todo[unit[0]][0], runs[unit[0]].run_dir / "train.log")]
                else:
                    results = run_batch_in_process([runs[i] for i in unit], [todo[i][0] for i in unit],
                                                   [resolved[i] for i in unit])  # fmt: skip
                seconds = time.perf_counter() - start
                interrupted = any(status == "interrupted" for status, _ in results)
                for i, (status, error) in zip(unit, results):
                    if status != "interrupted":
                        report(i, status, error, seconds)
                if interrupted:
                    break
        else:
            workers = Workers(limit.most)
            with ThreadPoolExecutor(max_workers=limit.most) as pool:
                pending: dict[Future, tuple[list[int], float]] = {}
                queue = list(units)
                try:
                    while queue or pending:
                        while queue and len(pending) < limit.limit:
                            unit = queue.pop(0)
                            announce(unit)
                            if len(unit) == 1:
                                job = pool.submit(workers.run, todo[unit[0]][0], runs[unit[0]].run_dir / "train.log")
                            else:
                                job = pool.submit(
                                    run_batch, workers, [runs[i] for i in unit], [todo[i][0] for i in unit], batches
                                )
                            pending[job] = (unit, time.perf_counter())
                        done, _ = wait(list(pending), timeout=1.0, return_when=FIRST_COMPLETED)
                        for fut in done:
                            unit, start = pending.pop(fut)
                            results = fut.result() if len(unit) > 1 else [fut.result()]
                            for i, (status, error) in zip(unit, results):
                                if status == "interrupted":
                                    interrupted = True
                                else:
                                    report(i, status, error, time.perf_counter() - start)
                            said = limit.learn([runs[i].run_dir for i in unit])
                            if said:
                                progress.line(said)
                        if interrupted:
                            workers.stop()
                            break
                except KeyboardInterrupt:
                    interrupted = True
                    workers.stop()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        progress.close()
    result = [outcomes.get(i, Outcome(run, "interrupted")) for i, run in enumerate(runs)]
    if interrupted:
        print("interrupted: run the same command again to finish the grid (finished runs are skipped, "
              "unfinished ones resume from their last checkpoint)", file=stream)  # fmt: skip
    return result


def _log_header(log: Path, run: RunSpec, args: list[str]) -> None:
    import shlex

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {run.experiment} / {run.wandb_name}\n")
        f.write(shlex.join(["python", "train.py", *args]) + "\n")


@dataclass
class ExperimentResult:
    """What :func:`run_experiment` did: the exit code (0 ok, 1 a run failed, 130 interrupted), one outcome per
    run, the finished runs as records, and the report it wrote."""

    code: int
    outcomes: list[Outcome]
    results: list[Any]
    table: str = ""
    results_path: Path | None = None
    plots: list[Path] = field(default_factory=list)


def other_runs(runs: list[RunSpec], max_steps: dict[str, int | None], overwrite: bool) -> list[RunSpec]:
    """The runs whose dirs hold a run of other training arguments (``run_state`` ``mismatch``: their
    ``run.json``), none with ``overwrite`` (which reruns them)."""
    return [] if overwrite else [r for r in runs if run_state(r, max_steps.get(str(r.run_dir))) == "mismatch"]


def check_no_other_runs(
    experiment: Experiment, runs: list[RunSpec], max_steps: dict[str, int | None], overwrite: bool
) -> None:
    """Without ``overwrite``, a grid whose run dirs hold runs of other training arguments (``other_runs``; e.g.
    the same file rerun with another ``--set``) is refused whole, in one line, before anything is written: the runs
    that could go on would report beside runs the command never made."""
    from fl_lightning.experiment.spec import ExperimentError

    other = other_runs(runs, max_steps, overwrite)
    if other:
        more = f" (and {len(other) - 1} more run dirs)" if len(other) > 1 else ""
        raise ExperimentError(
            f"{experiment.source}: {other[0].run_dir}{more} holds a run with other training arguments (its run.json); "
            "fix: --overwrite reruns them, or --runs-dir another folder"
        )


def choose(
    experiment: Experiment, tuning: list[TuneRun], lost: Collection[str] = ()
) -> dict[tuple[str, ...], Choice]:
    """Each tuned combination's best grid point: the best mean over tuning seeds of ``tune.metric`` read from the
    tuning runs' ``summary.json`` (validation figures: those runs evaluate on the validation split); ties go to
    the first point in grid order. A point with a missing run or figure cannot win (listed in ``missing``), nor
    can one with a run in ``lost`` (run dirs of the grid extension's failed runs), which blocks nothing."""
    from fl_lightning.experiment.spec import override

    out: dict[tuple[str, ...], Choice] = {}
    by_key: dict[tuple[str, ...], list[TuneRun]] = {}
    for t in tuning:
        by_key.setdefault(t.key, []).append(t)
    for key, runs in by_key.items():
        tune = next(p.tune for p in runs[0].run.points if p.tune is not None)
        values: dict[str, list[float]] = {}
        missing: list[str] = []
        dropped = sorted({t.point for t in runs if str(t.run.run_dir) in lost})
        for t in runs:
            if t.point in dropped:
                continue
            summary = read_json(t.run.run_dir / "summary.json")
            value = summary.get(tune.metric) if isinstance(summary, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                missing.append(str(t.run.run_dir))
                values.setdefault(t.point, []).append(float("nan"))
            else:
                values.setdefault(t.point, []).append(float(value))
        means = {p: sum(v) / len(v) for p, v in values.items()}
        ok = {p: m for p, m in means.items() if m == m}
        best = None
        if not missing and ok:
            best = (max if tune.mode == "max" else min)(ok, key=lambda p: ok[p])  # first of equal ones: grid order
        chosen = next(((p, v) for p, _, v in tune.points() if p == best), None)
        axes = {p.axis: p.label for p in runs[0].run.points if p.axis != "seed"}
        out[key] = Choice(
            key, axes, tune.metric, best, [override(k, v) for k, v in chosen[1].items()] if chosen else [], means,
            len(runs), list(tune.seeds), missing, lost=dropped,
        )  # fmt: skip
    return out


def run_experiment(
    experiment: Experiment,
    extra: list[str] | tuple[str, ...] = (),
    jobs: int | str = 1,
    overwrite: bool = False,
    dry_run: bool = False,
    batch_runs: int | None = None,
    report_dir: Path | None = None,
    metrics: list[str] | None = None,
    by: list[str] | None = None,
    fmt: str = "md",
    curve: str | None = None,
    out: TextIO | None = None,
) -> ExperimentResult:
    """Check every run, run the grid, then print and write the report (to ``report_dir``, default the
    experiment's folder ``<runs_dir>/<name>/``). ``batch_runs`` (default: the file's ``batch_runs``, else no limit)
    caps how many runs train as one batched job; 1 runs them one at a time."""
    from fl_lightning.experiment.collect import load_run_dir
    from fl_lightning.experiment.report import write_report
    from fl_lightning.experiment.spec import ExperimentError
    from fl_lightning.experiment.tuning import extend_grids
    from fl_lightning.experiment.validation import validate_runs

    out = out or sys.stdout
    if jobs != "auto" and (not isinstance(jobs, int) or jobs < 1):
        raise ExperimentError(f"--jobs {jobs}: expected ≥ 1, or auto")
    if batch_runs is not None and batch_runs < 1:
        raise ExperimentError(f"--batch-runs {batch_runs}: expected ≥ 1 (1 turns batching off)")
    batch_runs = batch_runs if batch_runs is not None else experiment.batch_runs
    runs = experiment.runs(extra)
    tuning = experiment.tuning_runs(extra)
    tune_specs = [t.run for t in tuning]
    resolved = validate_runs(experiment, tune_specs + runs)
    max_steps = {d: (cfg.get("trainer") or {}).get("max_steps") for d, cfg in resolved.items()}
    axes = " × ".join(f"{a} ({len(v)})" for a, v in experiment.axes.items()) or "a single run"
    print(f"experiment {experiment.name}: {len(runs)} runs = {axes}; run dirs under {experiment.out_dir}", file=out)
    if tuning:
        print(f"tuning stage first: {len(tuning)} runs on the validation split under {experiment.out_dir / 'tune'}; "
              "the runs above then get each method's chosen setting", file=out)  # fmt: skip
    if dry_run:
        for run in tune_specs:
            print(f"[{run_state(run, max_steps[str(run.run_dir)])}] {run.wandb_name}: {run.command()}", file=out)
        note = " (+ the chosen setting)" if tuning else ""
        for run in runs:
            state = run_state(run, max_steps[str(run.run_dir)]) if not tuning else "after tuning"
            print(f"[{state}] {run.wandb_name}: {run.command()}{note}", file=out)
        return ExperimentResult(0, [], [])
    check_no_other_runs(experiment, tune_specs + ([] if tuning else runs), max_steps, overwrite)  # (tuned: not known)
    experiment.out_dir.mkdir(parents=True, exist_ok=True)
    tune_outcomes: list[Outcome] = []
    choices: dict[tuple[str, ...], Choice] = {}
    if tuning:
        out.flush()
        tune_outcomes = execute(experiment, tune_specs, max_steps, jobs=jobs, overwrite=overwrite, configs=resolved,
                                batch_runs=batch_runs)  # fmt: skip
        if any(o.status == "interrupted" for o in tune_outcomes):
            return ExperimentResult(130, tune_outcomes, [])
        choices = choose(experiment, tuning)

        def run_more(grown_experiment: Experiment, specs: list[RunSpec]) -> list[Outcome]:
            more = validate_runs(grown_experiment, specs)
            resolved.update(more)
            max_steps.update({d: (cfg.get("trainer") or {}).get("max_steps") for d, cfg in more.items()})
            return execute(grown_experiment, specs, max_steps, jobs=jobs, overwrite=overwrite, configs=resolved,
                           batch_runs=batch_runs)  # fmt: skip

        tuning, grown, choices = extend_grids(experiment, extra, tuning, choices, run_more, choose, out)
        tune_outcomes += grown
        tune_specs = [t.run for t in tuning]
        if any(o.status == "interrupted" for o in grown):
            return ExperimentResult(130, tune_outcomes, [])
        (experiment.out_dir / "tune.json").write_text(json.dumps([c.record() for c in choices.values()], indent=1))
        for c in choices.values():
            where = ", ".join(f"{a}={lab}" for a, lab in c.axes.items())
            if c.point is None:
                print(f"tune: {where}: no choice ({len(c.missing)} tuning run(s) without {c.metric}); its runs are "
                      "skipped", file=out)  # fmt: skip
            else:
                print(f"tune: {where}: chose {c.label} ({c.metric} {c.means[c.point]:.4f}, mean over "
                      f"{len(c.seeds)} tuning seeds; {c.trials} trials)", file=out)  # fmt: skip
        runs = experiment.runs(extra, chosen={k: c.overrides for k, c in choices.items()})
        runs = [r for r in runs if experiment.tune_key(r.points) not in choices
                or choices[experiment.tune_key(r.points)].point is not None]  # fmt: skip
        resolved = validate_runs(experiment, runs)
        max_steps = {d: (cfg.get("trainer") or {}).get("max_steps") for d, cfg in resolved.items()}
    # a run refused because its dir holds another run's files (possible here only for a chosen setting after
    # tuning: check_no_other_runs refused the others up front) never runs: it is not listed in commands.sh, and
    # that other run is not reported as this grid's
    others = {str(r.run_dir) for r in other_runs(tune_specs + runs, max_steps, overwrite)}
    listed = [r for r in tune_specs + runs if str(r.run_dir) not in others]
    if listed:
        (experiment.out_dir / "commands.sh").write_text(
            f"# one line per run of {experiment.source}\n" + "\n".join(r.command() for r in listed) + "\n"
        )
    out.flush()
    outcomes = execute(
        experiment, runs, max_steps, jobs=jobs, overwrite=overwrite, configs=resolved, batch_runs=batch_runs
    )
    outcomes = tune_outcomes + outcomes
    if any(o.status == "interrupted" for o in outcomes):
        return ExperimentResult(130, outcomes, [])
    finished = [load_run_dir(r.run_dir) for r in runs
                if (r.run_dir / "summary.json").is_file() and str(r.run_dir) not in others]  # fmt: skip
    failed = [o for o in outcomes if o.status == "failed"]
    failed_code = bool(failed) or any(c.point is None for c in choices.values())
    result = ExperimentResult(1 if failed_code else 0, outcomes, finished)
    if finished:
        title = f"{experiment.name}: {experiment.description}".strip().rstrip(":")
        result.table, result.results_path, result.plots = write_report(
            finished,
            report_dir or experiment.out_dir,
            by or experiment.report.get("by"),
            metrics or experiment.report.get("metrics") or ["last10"],
            fmt,
            curve or experiment.report.get("curve"),
            title,
            tuned=[(c.axes, c.label, c.trials) for c in choices.values()] or None,
        )
        print(f"\n{result.table}\n", file=out)
        for p in result.plots:
            print(f"plot: {p}", file=out)
    for o in failed:
        print(f"failed: {o.run.run_dir}: {o.error} (log: {o.run.run_dir / 'train.log'})", file=sys.stderr)
        print(f"  rerun alone: {o.run.command()}", file=sys.stderr)
    return result
