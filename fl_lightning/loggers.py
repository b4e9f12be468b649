"""Loggers of a run dir: a CSV log that a resumed run extends, and the W&B run id kept in the run dir.

A resumed run (``--ckpt_path``) continues the SAME W&B run (its id is stored in ``<run_dir>/wandb_id``, and
``WandbLogger(id=..., resume="allow")`` reopens it) and appends to the same ``metrics.csv`` (Lightning's
``CSVLogger`` deletes an existing file: :class:`ResumableCSVLogger` keeps its rows before the resumed round and
drops the rows of rounds that are recomputed after the checkpoint).
"""

from __future__ import annotations

import csv
import os
import secrets
import string
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

WANDB_ID_FILE = "wandb_id"


class ResumingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer that, when ``resume`` is set, keeps an existing ``metrics.csv``: its header is
    reused, and at the first write the rows of steps at or after the first new step are dropped (they were
    logged after the checkpoint the run resumes from and are recomputed)."""

    def __init__(self, log_dir: str, resume: bool = False) -> None:
        self.resume = resume
        super().__init__(log_dir)
        self._truncate = resume and os.path.isfile(self.metrics_file_path)
        if self._truncate:
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])

    def _check_log_dir_exists(self) -> None:
        if not self.resume and os.path.isfile(self.metrics_file_path):
            os.remove(self.metrics_file_path)  # the CLI refuses dirs that hold a run unless --overwrite

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        if self._truncate and step is not None:
            self._truncate = False
            with open(self.metrics_file_path, newline="") as f:
                reader = csv.DictReader(f)
                header = reader.fieldnames or []
                kept = [row for row in reader if row.get("step") not in (None, "") and int(float(row["step"])) < step]
            with open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header)
                writer.writeheader()
                writer.writerows(kept)
        super().log_metrics(metrics_dict, step)


class ResumableCSVLogger(CSVLogger):
    """``CSVLogger(save_dir=run_dir, name="", version="")`` whose ``metrics.csv`` survives a resume."""

    def __init__(self, save_dir: str, resume: bool = False, **kwargs: Any) -> None:
        super().__init__(save_dir=save_dir, name="", version="", **kwargs)
        self.resume = resume

    @property
    @rank_zero_experiment
    def experiment(self) -> ResumingExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ResumingExperimentWriter(log_dir=self.log_dir, resume=self.resume)
        return self._experiment


def is_launching_process() -> bool:
    """Whether this is the process that owns the run dir: global rank 0 (the processes that Lightning's DDP
    launcher starts, and other nodes, have a non-zero ``RANK``/``LOCAL_RANK``/``NODE_RANK``/``SLURM_PROCID``)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0 and os.environ.get("NODE_RANK", "0") in ("", "0")


def wandb_run_id(run_dir: Path, resume: bool) -> str:
    """The W&B run id of ``run_dir``: the stored one when resuming (or when a W&B sweep agent chose it), else a
    new one, stored for the next resume. Only the launching process writes it (the others only log through a
    dummy W&B run)."""
    path = run_dir / WANDB_ID_FILE
    agent_id = os.environ.get("WANDB_RUN_ID") if os.environ.get("WANDB_SWEEP_ID") else None
    stored = path.read_text().strip() if path.is_file() else ""
    if stored and (resume or not is_launching_process()):
        return stored
    if agent_id:
        run_id = agent_id
    else:  # W&B's own format: 8 characters of [a-z0-9]
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    if is_launching_process():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
    return run_id


def logged_offline(run_dir: Path, run_id: str) -> dict[int, set[str]]:
    """What the earlier processes of W&B run ``run_id`` already wrote into ``run_dir/wandb/offline-run-*``: the
    metric keys of every ``trainer/global_step``."""
    from fl_lightning.wandb_files import offline_runs

    done: dict[int, set[str]] = {}
    if not (run_dir / "wandb").is_dir():
        return done
    for run in offline_runs(run_dir / "wandb"):
        if run.id != run_id:
            continue
        for row in run.history:
            step = row.get("trainer/global_step")
            if isinstance(step, (int, float)):
                done.setdefault(int(step), set()).update(k for k in row if not k.startswith("_"))
    return done


def continuing_wandb_logger(run_dir: Path, run_id: str, **kwargs: Any) -> Any:
    """A ``WandbLogger`` for a resumed offline run: a new ``offline-run-*`` folder with the same run id (``wandb
    sync`` uploads the folders in order into one run), which leaves out every (round, metric) that an earlier folder
    of the run already holds, so that no round is logged twice (the resumed process recomputes the rounds after
    its checkpoint; the killed one may have logged some of them)."""
    from lightning.pytorch.loggers import WandbLogger

    done = logged_offline(run_dir, run_id)

    class ContinuingWandbLogger(WandbLogger):
        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            if step is not None and int(step) in done:
                metrics = {k: v for k, v in metrics.items() if k not in done[int(step)]}
                if not metrics:
                    return
            super().log_metrics(metrics, step)

    return ContinuingWandbLogger(id=run_id, resume="allow", save_dir=str(run_dir), **kwargs)


# ---- what a run dir holds ----------------------------------------------------------------------------------------

#: files and folders a training run writes into its run dir (``run.json`` and ``train.log`` are the experiment
#: runner's and survive ``--overwrite``)
RUN_FILES = ("summary.json", "metrics.csv", "history.json", "clients.csv", "checkpoints", "wandb", WANDB_ID_FILE,
             "config.yaml", "hparams.yaml")  # fmt: skip


def run_dir_state(run_dir: Path) -> str | None:
    """``finished`` (it has a ``summary.json``), ``unfinished`` (a checkpoint to resume from), ``stale`` (files of a
    run that stopped before its first checkpoint: nothing to resume, nothing to keep) or ``None`` (no run)."""
    if (run_dir / "summary.json").is_file():
        return "finished"
    if any((run_dir / "checkpoints").glob("*.ckpt")):
        return "unfinished"
    if any((run_dir / name).exists() for name in RUN_FILES):
        return "stale"
    return None


def clear_run_dir(run_dir: Path) -> None:
    """Remove what a previous run wrote into ``run_dir`` (``--overwrite``)."""
    import shutil

    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ---- per-client figures in W&B and in the run dir ------------------------------------------------------------


def wandb_loggers(loggers: Any) -> list[Any]:
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in loggers if isinstance(lg, WandbLogger)]


def client_histogram_callback(every: int):
    """A callback that logs ``val/acc_clients`` (or ``val/mse_clients``), a W&B histogram of the per-client
    figure, at every ``every``-th evaluation of fit and at the last round."""
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.trainer.states import TrainerFn

    class ClientHistogram(Callback):
        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            result = getattr(pl_module, "last_evaluation", None)
            if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING or result is None:
                return
            last = pl_module.rounds_trained >= trainer.max_steps
            if len(pl_module.history) % every and not last:
                return
            import wandb

            regression = pl_module.fed.num_classes is None
            values = (result.loss_per_client if regression else result.acc_per_client).double()
            if result.samples_per_client is not None:
                values = values[result.samples_per_client > 0]
            key = "val/mse_clients" if regression else "val/acc_clients"
            for logger in wandb_loggers(trainer.loggers):
                logger.log_metrics({key: wandb.Histogram(values.numpy())}, step=trainer.global_step)

    return ClientHistogram()


def write_clients_csv(path: Path, rows: list[dict[str, float]]) -> None:
    """One line per client; a figure the client does not have (NaN: no test rows) is an empty cell."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["client", "samples", "accuracy", "loss"])
        writer.writeheader()
        writer.writerows({k: "" if isinstance(v, float) and v != v else v for k, v in row.items()} for row in rows)


def log_run_end(loggers: Any, summary: dict[str, Any], rows: list[dict[str, float]] | None) -> list[str]:
    """The run summary into ``wandb.summary`` (``summary/<key>``) and the per-client table ``clients/final``;
    then the W&B run is finished (one W&B run per train.py run, also in one process). Returns ``finish_wandb``'s
    lines, for the caller to print last."""
    for logger in wandb_loggers(loggers):
        run = logger.experiment
        if "ran" in summary:  # the path that ran and the batched job it shared, beside the config that asked for it
            run.config.update({"ran": summary["ran"]}, allow_val_change=True)
        run.summary.update({f"summary/{k}": v for k, v in summary.items() if k != "ran"})
        if rows:
            columns = ["client", "samples", "accuracy", "loss"]
            logger.log_table("clients/final", columns=columns, data=[[r[c] for c in columns] for r in rows])
    return finish_wandb(loggers)


def wandb_banner_silenced() -> bool:
    """W&B's own banner and footer (its version, the run history sparklines and summary, where its logs are) say
    nothing a user acts on: silenced unless the user asks for them with ``WANDB_SILENT=false`` (or
    ``WANDB_QUIET=false``); ``wandb_where`` then prints the one line that matters."""
    asked = [os.environ.get(name, "").strip().lower() for name in ("WANDB_SILENT", "WANDB_QUIET")]
    return not any(value in ("false", "0", "no") for value in asked)


def wandb_where(run: Any) -> str:
    """The one line of W&B's footer a user acts on: an offline run's folder and the command that uploads it, or an
    online run's page."""
    if run.settings.mode == "offline":
        folder = Path(run.settings.sync_dir)
        return f"wandb: offline run in {folder}; upload it with: wandb sync {folder}"
    return f"wandb: {run.url}"


def finish_wandb(loggers: Any) -> list[str]:
    """Finish the W&B runs of ``loggers``; when their own footer is silenced (``wandb_banner_silenced``), returns
    the line that says where each run is (``wandb_where``), for the caller to print last."""
    lines = []
    for logger in wandb_loggers(loggers):
        run = logger.experiment
        if wandb_banner_silenced():
            lines.append(wandb_where(run))
        run.finish()
    return lines
