"""A run's directory: one run per dir, and how a command may start, restart or resume the run it holds.

``plan_run_dir`` decides from what the dir holds (``loggers.run_dir_state``) and the command's ``--ckpt_path`` and
``--overwrite`` what happens (nothing is changed there; ``clear_planned`` clears once every other check passed); a
resume must keep the run's identity (``check_same_run``, ``fl_lightning.identity``); ``resolve_ckpt`` finds a
loadable checkpoint and ``before_the_end`` restarts a run killed after its last round. ``fl_lightning.cli`` uses
them; like it, this module imports only the standard library at the top.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError
from fl_lightning.identity import identity_differences


def default_run_dir(cfg: Any) -> Path:
    """``runs/<config file names>``; a trial of a W&B sweep agent: ``runs/sweep-<sweep id>/<run id>``."""
    if os.environ.get("WANDB_SWEEP_ID") and os.environ.get("WANDB_RUN_ID"):
        return Path("runs") / f"sweep-{os.environ['WANDB_SWEEP_ID']}" / os.environ["WANDB_RUN_ID"]
    configs = cfg.get("config") or []
    stem = "_".join(Path(str(c)).stem for c in configs) or "run"
    return Path("runs") / stem


class RunFinished(Exception):
    """``--ckpt_path`` on a run whose ``summary.json`` already reports ``trainer.max_steps`` rounds."""

    def __init__(self, run_dir: Path, summary: dict[str, Any]) -> None:
        super().__init__(str(run_dir))
        self.run_dir, self.summary = run_dir, summary


def guard_run_dir(
    run_dir: Path, ckpt_path: str | None, overwrite: bool, max_steps: int | None, config: dict[str, Any] | None = None
) -> str | None:
    """:func:`plan_run_dir`, and the clearing it asks for done at once. Returns the checkpoint argument."""
    ckpt, clear = plan_run_dir(run_dir, ckpt_path, overwrite, max_steps, config)
    clear_planned(run_dir, clear)
    return ckpt


def clear_planned(run_dir: Path, why: str | None) -> None:
    """Clear ``run_dir`` as :func:`plan_run_dir` decided (``why``: ``overwrite``, ``stale`` or ``None``: nothing)."""
    from fl_lightning.loggers import clear_run_dir

    if why is None:
        return
    clear_run_dir(run_dir)
    if why == "stale":
        print(f"note: {run_dir} held a run that stopped before its first checkpoint: starting it afresh")


def plan_run_dir(
    run_dir: Path, ckpt_path: str | None, overwrite: bool, max_steps: int | None, config: dict[str, Any] | None = None
) -> tuple[str | None, str | None]:
    """A run dir holds one run: starting again in it needs ``--overwrite true``; resuming a finished run is a no-op;
    resuming with a config that changes results is refused (``config`` against the run's ``config.yaml``). A dir
    left by a run that stopped before its first checkpoint is no trap: it is cleared and the run starts afresh
    (also with ``--ckpt_path last``). Nothing is changed here: returns the checkpoint argument to use (``None``:
    start from round 0) and whether the dir is to be cleared before the run starts (``overwrite``, ``stale``,
    ``None``), which :func:`start_run` does once every other check has passed."""
    from fl_lightning.loggers import run_dir_state

    state = run_dir_state(run_dir)
    if overwrite:
        return (None if ckpt_path == "last" else ckpt_path), ("overwrite" if state is not None else None)
    if state == "stale":
        return (None if ckpt_path == "last" else ckpt_path), "stale"
    if state is None:
        return ckpt_path, None
    if ckpt_path is None:
        what = "an unfinished run" if state == "unfinished" else "a finished run (summary.json)"
        raise ConfigError(
            f"{run_dir} holds {what}: resume it with --ckpt_path last, start it again with --overwrite true, "
            "or pick another --run_dir"
        )
    if config is not None:
        check_same_run(run_dir, config)
    if state == "finished":
        summary = json.loads((run_dir / "summary.json").read_text())
        if not max_steps or max_steps < 0 or summary.get("rounds", 0) >= max_steps or summary.get("stopped_early"):
            raise RunFinished(run_dir, summary)
    return ckpt_path, None


def config_differences(saved: dict[str, Any], config: dict[str, Any]) -> list[str]:
    """``key saved -> new`` for every identity leaf (``fl_lightning.identity``) that differs (a key that only one
    side has, e.g. an option added to the code since the run started, is not compared)."""
    return identity_differences(saved, config, only_shared=True)


def check_same_run(run_dir: Path, config: dict[str, Any]) -> None:
    """A resume continues the run its ``config.yaml`` describes: a difference that changes results is refused."""
    from fl_lightning.errors import load_yaml

    path = run_dir / "config.yaml"
    if not path.is_file():
        return
    saved = load_yaml(path)
    diffs = config_differences(saved if isinstance(saved, dict) else {}, config)
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
        raise ConfigError(
            f"--ckpt_path: {run_dir} was trained with other settings ({path}): {shown}; fix: resume with the run's "
            "own settings (only trainer.max_steps, callbacks, logging and W&B options may change), or start a new run "
            "with another --run_dir"
        )


def checkpoint_problem(path: Path) -> str | None:
    """``None`` if ``path`` loads (with ``weights_only=True``), else a short reason."""
    import torch

    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, wrong file type…
        return str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
    return None


def resolve_ckpt(ckpt_path: str | None, run_dir: Path) -> str | None:
    """``last`` → the newest loadable checkpoint of ``run_dir`` (a corrupt ``last.ckpt`` falls back to the
    previous round checkpoint, with a warning); an explicit path must exist and load."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        folder = run_dir / "checkpoints"
        candidates = [folder / "last.ckpt", *sorted(folder.glob("round*.ckpt"), reverse=True)]
        candidates = [c for c in candidates if c.exists()]
        if not candidates:
            raise ConfigError(f"--ckpt_path last: no checkpoint in {folder} (train once with the same config first)")
        for path in candidates:
            problem = checkpoint_problem(path)
            if problem is None:
                if path != candidates[0]:
                    print(f"warning: {candidates[0]} is unreadable; resuming from {path}", file=sys.stderr)
                return str(path)
        raise ConfigError(f"--ckpt_path last: every checkpoint in {folder} is unreadable ({problem})")
    path = Path(ckpt_path)
    if not path.exists():
        raise ConfigError(f"--ckpt_path: file {path} does not exist")
    problem = checkpoint_problem(path)
    if problem is not None:
        others = sorted(p.name for p in path.parent.glob("*.ckpt") if p != path)
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({problem}); other checkpoints there: {others}")
    return str(path)


def checkpoint_step(path: str | Path) -> int:
    import torch

    return int(torch.load(path, map_location="cpu", weights_only=True).get("global_step", 0))


def before_the_end(ckpt: str, run_dir: Path, max_steps: int) -> str | None:
    """A run killed after its last round but before ``summary.json``: Lightning would resume at the end and do
    nothing, so the run restarts from its newest checkpoint before the last round (or from round 0) and finishes
    with its summary, ``clients.csv`` and W&B end (the same numbers: resume is exact)."""
    if max_steps is None or max_steps < 0 or checkpoint_step(ckpt) < max_steps:
        return ckpt
    earlier = []
    for path in sorted((run_dir / "checkpoints").glob("round*.ckpt"), reverse=True):
        if checkpoint_problem(path) is None and checkpoint_step(path) < max_steps:
            earlier.append(str(path))
    start = earlier[0] if earlier else None
    print(f"note: {run_dir} stopped after its last round, before summary.json: recomputing from "
          f"{start or 'round 0'} to write it")  # fmt: skip
    return start
