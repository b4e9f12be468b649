"""``BatchedRuns``: several ``train.py`` runs as one job, their client updates stacked round by round.

Each run is given as its ``train.py`` argument list and runs exactly as ``python train.py ARGS`` would: its
own parsing (``fl_lightning.cli``), run dir, ``metrics.csv``, ``summary.json``, ``config.yaml``, W&B run and
checkpoints. What changes is where its clients train: in the lockstep (``lockstep.Lockstep``), together with
the other runs' clients of the same round (``cohorts``), and its data rows in one shared pool
(``shared_data``). A batched job has no checkpoint of its own: it is its runs' checkpoints, and it resumes by
starting every run with ``--ckpt_path last`` again (alone or batched, with any partners: a run's numbers do not
depend on them).

Runs share a batch when their identities are equal but for the seed (``batching.batch_key``, derived from the
resolved configs: ``check_batchable`` refuses others before anything starts, naming the first key that differs).
What a resume may change may differ too (rounds, callbacks, logging, W&B, checkpoint cadence). Each run trains on
the path it takes alone (``executor.decide``); the stacked ones train their clients together in one call per round.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError
from fl_lightning.experiment.run_axis.batching import CARRIED_PER_RUN, batch_differences, batch_key, multi_process
from fl_lightning.experiment.run_axis.lockstep import Interrupted, Lockstep
from fl_lightning.experiment.run_axis.shared_data import RowPool


@dataclass
class RunOutcome:
    """What one run of a batched job did: ``done`` (its summary), ``failed`` (one-line error) or ``interrupted``."""

    args: list[str]
    status: str = "pending"
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    #: the run was refused before it wrote anything (a ``ConfigError`` or a missing file: train.py's exit code 2)
    refused: bool = False


def parse_config(args: Sequence[str]) -> dict[str, Any]:
    """``train.py args`` parsed with train.py's parser, nothing instantiated: the resolved config as a dict (the
    experiment runner's parse-only check, :func:`fl_lightning.experiment.validation.parse_train_args`)."""
    from fl_lightning.experiment.validation import parse_train_args

    return parse_train_args(list(args))


def parse_configs(arg_lists: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """``parse_config`` of every argument list, once per distinct list without the arguments that only name or
    seed a run (``experiment.validation.naming_free``: a grid's seeds parse once; parsing builds train.py's whole
    parser). The batch key does not depend on those (``batching.CARRIED_PER_RUN`` and what a resume may change)."""
    from fl_lightning.experiment.validation import naming_free

    cache: dict[tuple[str, ...], dict[str, Any]] = {}
    out = []
    for args in arg_lists:
        key = naming_free(list(args))
        if key not in cache:
            cache[key] = parse_config(args)
        out.append(cache[key])
    return out


def check_batchable(configs: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> None:
    """One ``ConfigError`` line if the runs cannot share a batch: a multi-process trainer, or an identity that
    differs from the first run's in more than what the run axis carries per run (``batching``)."""
    names = list(names or [f"run {i}" for i in range(len(configs))])
    for name, config in zip(names, configs):
        why = multi_process(config)
        if why:
            raise ConfigError(f"{name}: batched runs train in one process; {why} (run it without batching)")
        diffs = batch_differences(configs[0], config)
        if diffs:
            more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
            raise ConfigError(
                f"{name} cannot share a batch with {names[0]}: {_short(diffs[0])}{more}; a batched job's runs differ "
                f"only in {', '.join(CARRIED_PER_RUN)} and what a resume may change (run them as separate jobs)"
            )


def _last_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``args``."""
    given = [a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args)
             if a.split("=", 1)[0] == flag and ("=" in a or i + 1 < len(args))]  # fmt: skip
    return given[-1] if given else None


def run_dir_of(args: Sequence[str], config: dict[str, Any]) -> Path:
    """Where the run writes, as train.py decides it: its last ``--run_dir`` argument, else its config's, else
    ``runs/<config names>`` (``cli.default_run_dir``)."""
    from fl_lightning.cli import default_run_dir

    run_dir = _last_value(args, "--run_dir") or config.get("run_dir")
    return Path(str(run_dir)) if run_dir else default_run_dir(config)


def check_own_run_dirs(
    arg_lists: Sequence[Sequence[str]], configs: Sequence[dict[str, Any]], names: Sequence[str]
) -> None:
    """One ``ConfigError`` line if two runs of a job would write one run dir (their files would mix)."""
    seen: dict[str, str] = {}
    for name, args, config in zip(names, arg_lists, configs):
        run_dir = run_dir_of(args, config)
        key = str(run_dir.resolve())
        if key in seen:
            raise ConfigError(f"{name} and {seen[key]} both write run_dir {run_dir}: give each run its own --run_dir")
        seen[key] = name


def check_run_dirs(
    arg_lists: Sequence[Sequence[str]], configs: Sequence[dict[str, Any]], names: Sequence[str]
) -> None:
    """Each run's dir as train.py's fit will find it, checked before any run starts (``cli.plan_run_dir``, which
    changes nothing): a dir that cannot hold a run, one that holds a run when neither ``--ckpt_path last`` nor
    ``--overwrite true`` is given, or a resume with settings that change results refuses the whole job in one line,
    so that a refused job leaves every run dir as it was (a finished run resumed is no refusal: it reports itself)."""
    import json

    from fl_lightning.cli import RunFinished, plan_run_dir
    from fl_lightning.config_checks import run_dir_problem
    from fl_lightning.errors import one_line

    for name, args, config in zip(names, arg_lists, configs):
        trainer = config.get("trainer") or {}
        if trainer.get("fast_dev_run"):  # writes nothing
            continue
        run_dir = run_dir_of(args, config)
        problem = run_dir_problem(run_dir)
        if problem:
            raise ConfigError(f"{name}: {problem}; fix: pick another --run_dir")
        plain = json.loads(json.dumps(config, default=str))  # as train.py dumps it for the resume check
        seed = _last_value(args, "--seed_everything")  # runs that differ only in it share one parse (parse_configs)
        if seed is not None and seed.lstrip("-").isdigit():
            plain["seed_everything"] = int(seed)
        # a caller's configs may be parsed without the arguments it adds per run (the runner's --ckpt_path last)
        ckpt_path = _last_value(args, "--ckpt_path") or config.get("ckpt_path")
        overwrite = _last_value(args, "--overwrite")
        overwrite = overwrite.lower() == "true" if overwrite is not None else bool(config.get("overwrite"))
        try:
            plan_run_dir(run_dir, ckpt_path, overwrite, trainer.get("max_steps"), plain)
        except RunFinished:
            continue
        except ConfigError as exc:
            raise ConfigError(f"{name}: {one_line(exc)}") from None


def _short(text: str) -> str:
    return text if len(text) < 160 else text[:157] + "..."


def _allow_concurrent_wandb_runs(configs: Sequence[dict[str, Any]]) -> None:
    """Several W&B runs open at once in one process (one per batched run) need ``reinit='create_new'``."""
    from fl_lightning.cli import _wandb_mode

    if all(_wandb_mode(str((c.get("wandb") or {}).get("mode", "auto"))) == "disabled" for c in configs):
        return
    import wandb

    wandb.setup(wandb.Settings(reinit="create_new"))


class BatchedRuns:
    """Train the runs ``arg_lists`` (each a ``train.py`` argument list) as one batched job.

    ``run()`` returns one ``RunOutcome`` per run, in order. A run that fails is reported and the others go on;
    Ctrl-C stops every run (each keeps its last round checkpoint: run the same job with ``--ckpt_path last``).
    """

    def __init__(
        self,
        arg_lists: Sequence[Sequence[str]],
        names: Sequence[str] | None = None,
        check: bool = True,
        before_fit: Callable[[int, Any], None] | None = None,
        logs: Sequence[str | Path] | None = None,
        configs: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        if not arg_lists:
            raise ConfigError("a batched job needs at least one run")
        self.arg_lists = [list(a) for a in arg_lists]
        self.names = list(names or [f"run {i}" for i in range(len(self.arg_lists))])
        #: the runs' resolved configs (``parse_config``; given by a caller that parsed them already)
        self.configs = list(configs) if configs is not None else parse_configs(self.arg_lists) if check else []
        if check:
            check_batchable(self.configs, self.names)
            check_own_run_dirs(self.arg_lists, self.configs, self.names)
            check_run_dirs(self.arg_lists, self.configs, self.names)
        self.lockstep = Lockstep()
        self.pool = RowPool()
        self.outcomes = [RunOutcome(a) for a in self.arg_lists]
        self._ended = [False] * len(self.arg_lists)  #: each run's thread has finished (set last, in the thread)
        self.modules: list[Any] = [None] * len(self.arg_lists)
        self._before_fit = before_fit
        self.log_paths = [Path(p) for p in logs] if logs is not None else None  #: each run's console, if given
        self._files: list[Any] = []

    def run(self) -> list[RunOutcome]:
        if self.configs:
            _allow_concurrent_wandb_runs(self.configs)
        threads = [
            threading.Thread(target=self._thread, args=(i,), name=f"run-axis-{i}", daemon=True)
            for i in range(len(self.arg_lists))
        ]
        self.lockstep.enter(len(threads))
        self._files = [open(p, "a", buffering=1) for p in self.log_paths] if self.log_paths else []  # noqa: SIM115
        try:
            for t in threads:
                t.start()
            self._wait_for_runs()
        except KeyboardInterrupt:
            self.lockstep.stop()
            for i, t in enumerate(threads):
                if t.ident is None:  # interrupted before it started
                    self._ended[i], self.outcomes[i].status = True, "interrupted"
            self._wait_for_runs(interruptible=False)
        finally:
            for t in threads:
                if t.ident is not None:
                    t.join()  # it has ended: setting its flag was its last step
            self.lockstep.restore_output()
            for f in self._files:
                f.close()
        return self.outcomes

    def _wait_for_runs(self, interruptible: bool = True) -> None:
        """Until every run's thread has ended. It polls its own flags: ``Thread.join`` interrupted by Ctrl-C marks
        a live thread as stopped (CPython bpo-45274 handling up to 3.12), and the interpreter would then exit under
        a running run. After a stop, further Ctrl-C are ignored here (each run stops at its next step)."""
        while not all(self._ended):
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                if interruptible:
                    raise

    def _join(self, i: int, cli: Any) -> None:
        """Right before run ``i`` trains: pin its seed, put its rows in the shared pool, join the lockstep under
        the batch key of its own resolved config (whatever the caller said of it)."""
        datamodule, module = cli.datamodule, cli.model
        datamodule.seed = datamodule.resolved_seed  # PL_GLOBAL_SEED is process-wide: the next run's parse resets it
        datamodule.federated = self.pool.share(datamodule.federated)
        module.run_axis = self.lockstep
        self.lockstep.join(module, batch_key(cli.config.as_dict()), self.names[i], self.names)
        self.modules[i] = module
        if self._before_fit is not None:
            self._before_fit(i, cli)

    def _thread(self, i: int) -> None:
        outcome = self.outcomes[i]
        try:
            self._run_thread(i, outcome)
        finally:
            self._ended[i] = True  # after the lockstep's lock is released: the main thread may go on

    def _run_thread(self, i: int, outcome: RunOutcome) -> None:
        from fl_lightning import cli
        from fl_lightning.engine.module import TrainingDiverged
        from fl_lightning.errors import one_line

        with self.lockstep.lock:
            if self._files:
                self.lockstep.logs[threading.get_ident()] = self._files[i]
                self.lockstep.activate()
            try:
                if self.lockstep.stopping:
                    raise Interrupted()
                outcome.summary = cli.run(outcome.args, before_fit=lambda c: self._join(i, c))
                outcome.status = "done"
            except Interrupted:
                outcome.status, outcome.error = "interrupted", "interrupted"
            except (ConfigError, FileNotFoundError, TrainingDiverged) as exc:
                outcome.status, outcome.error = "failed", one_line(exc)
                outcome.refused = not isinstance(exc, TrainingDiverged)
                if self._files:  # into the run's own log; without logs the caller reports the job's outcomes
                    print(f"error: {self.names[i]}: {outcome.error}", file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - reported per run; the other runs go on
                if self.lockstep.stopping:
                    outcome.status, outcome.error = "interrupted", "interrupted"
                else:
                    outcome.status, outcome.error = "failed", one_line(exc)
                    traceback.print_exc()
            finally:
                self.lockstep.leave()


def run_batched(arg_lists: Sequence[Sequence[str]], names: Sequence[str] | None = None) -> list[RunOutcome]:
    """Train ``train.py`` runs (argument lists) as one batched job; one ``RunOutcome`` per run."""
    return BatchedRuns(arg_lists, names).run()
