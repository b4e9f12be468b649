"""Ranges of numeric arguments, checked once on the parsed config before anything is built (train.py, the
experiment runner's pre-check and the run axis all parse through ``fl_lightning.cli``).

The rules come from the argument's name and its declared default (``inspect.signature`` of the class the
config names), so an algorithm written later gets them without registering anything:

- a learning rate (``lr``, ``*_lr``) is > 0 and finite;
- a count of work (``*epochs``, ``*_steps``, ``*_iters``, ``*_rounds``, ``batch_size``) is an integer ≥ 1, or ≥ 0
  where the declared default is 0 (0 then means "off", e.g. ``power_iters``, ``warmup_rounds``);
- ``trainer.max_steps`` ≥ 1 (the rounds), ``trainer.val_check_interval`` an integer ≥ 1 (rounds) or a fraction in
  (0, 1], ``trainer.check_val_every_n_epoch`` and ``trainer.log_every_n_steps`` ≥ 1, ``checkpoint_every`` ≥ 1,
  ``wandb.mode`` one of auto/online/offline/disabled, ``wandb.histogram_every`` ≥ 0, ``trainer.devices`` ≥ 1 or -1
  (or ``auto``), ``seed_everything`` in [0, 2**32) (numpy's seeds);
- ``model.compile: cudagraphs`` only where the trainer runs on CUDA.

Only classes of this project (``fl_lightning.*``, ``datamodules.*``) are checked by name; ``torch.optim`` classes
check their own arguments. Each refusal is one :class:`ConfigError` line: the key, where it was set (the command
line or the config file and line), the value given, what is allowed and the fix.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import re
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError, yaml_line

LR = re.compile(r"(^|_)lr$")
COUNT = re.compile(r"(epochs|_steps|_iters|_rounds|^batch_size)$")
OWN = ("fl_lightning.", "datamodules.")
WANDB_MODES = ("auto", "online", "offline", "disabled")


def where(key: str, args: list[str]) -> str:
    """Where ``key`` got its value: the last of the command line's ``--key`` and the ``--config`` files that set
    it (later ones win, as in the parser), named as ``--key`` or ``FILE line N``; '' if none does."""
    flags = {f"--{k}" for k in [key, *_init_args_spellings(key)]}
    found = ""
    for i, a in enumerate(args):
        if a in flags or a.split("=", 1)[0] in flags and "=" in a:
            found = f"--{key}"
        path = args[i + 1] if a == "--config" and i + 1 < len(args) else a[9:] if a.startswith("--config=") else None
        if path is not None:
            line = yaml_line(path, key)
            found = f"{path} line {line}" if line is not None else found
    return found


def locate(line: str, args: list[str]) -> str:
    """A one-line parser error ``key: …`` with the config file that set the key: ``key (FILE line N): …`` (a key
    from the command line is already where the user typed it)."""
    key, sep, rest = line.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*", key):
        return line
    source = where(key, args)
    return f"{key} ({source}):{rest}" if source and not source.startswith("--") else line


def _init_args_spellings(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join([*parts[:i], "init_args", *parts[i:]]) for i in range(1, len(parts))]


def refuse(key: str, value: Any, allowed: str, args: list[str], fix: str | None = None) -> ConfigError:
    source = where(key, args)
    at = f" ({source})" if source else ""
    fix = fix or f"set {key} to a value that {allowed.replace('must be', 'is', 1)}"
    shown = "null" if value is None else repr(value)
    return ConfigError(f"{key} {allowed}, got {shown}{at}; fix: {fix}")


def init_default(cls: type, name: str) -> Any:
    """The default of argument ``name`` of ``cls``'s constructor, looked up the class hierarchy while
    constructors pass ``**kwargs`` on to their base (as jsonargparse resolves them); ``inspect.Parameter.empty``
    when there is none."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters
        if name in params:
            return params[name].default
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return inspect.Parameter.empty


def _default(class_path: str | None, name: str) -> Any:
    if not class_path:
        return inspect.Parameter.empty
    module, _, attr = class_path.rpartition(".")
    try:
        return init_default(getattr(importlib.import_module(module), attr), name)
    except (ImportError, AttributeError, TypeError, ValueError):
        return inspect.Parameter.empty


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _walk(node: Any, key: str, class_path: str | None, args: list[str]) -> None:
    """Check every leaf of one of our classes' arguments below ``node`` (``key`` is its dotted name)."""
    if not isinstance(node, dict):
        return
    if "class_path" in node:
        path = str(node["class_path"])
        if path.startswith(OWN):
            _walk(node.get("init_args") or {}, key, path, args)
        return
    for name, value in node.items():
        full = f"{key}.{name}" if key else name
        if isinstance(value, dict):
            _walk(value, full, None, args)
            continue
        if value is None and (LR.search(name) or COUNT.search(name)):
            default = _default(class_path, name)
            if _is_number(default):
                raise refuse(full, None, f"must be a number (its default is {default}; null is not allowed)", args,
                             f"set {full} to a number or delete the line to keep the default")  # fmt: skip
        if not _is_number(value):
            continue
        if LR.search(name) and not 0 < value < math.inf:  # an infinite rate trains to NaN: every client dropped
            raise refuse(full, value, "must be positive and finite (> 0, a learning rate)", args,
                         f"set {full} to a positive number, e.g. 0.01")  # fmt: skip
        if COUNT.search(name):
            default = _default(class_path, name)
            low = 0 if _is_number(default) and default == 0 else 1
            if isinstance(value, float) or value < low:
                word = "must be positive (an integer ≥ 1)" if low == 1 else "must be an integer ≥ 0 (0: off)"
                raise refuse(full, value, word, args, f"set {full} to an integer ≥ {low}")


def check_ranges(config: dict[str, Any], args: list[str]) -> None:
    """Refuse the first out-of-range numeric argument of ``config`` (the parsed config as a plain dict, with
    ``class_path``/``init_args`` nodes; ``args`` the command line, to say where a value was set)."""
    trainer = config.get("trainer") or {}
    steps = trainer.get("max_steps")
    if _is_number(steps) and steps < 1:
        raise refuse("trainer.max_steps", steps, "must be positive (an integer ≥ 1: the communication rounds)", args,
                     "set trainer.max_steps to the number of rounds, e.g. --trainer.max_steps 100")  # fmt: skip
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float) and not 0 < interval <= 1 or isinstance(interval, int) and interval < 1:
        raise refuse("trainer.val_check_interval", interval, "must be an integer ≥ 1 (evaluate every N rounds) or a "
                     "fraction in (0, 1]", args, "e.g. --trainer.val_check_interval 5")  # fmt: skip
    for name in ("check_val_every_n_epoch", "log_every_n_steps"):
        value = trainer.get(name)
        if _is_number(value) and value < 1:
            raise refuse(f"trainer.{name}", value, "must be positive (an integer ≥ 1)", args)
    devices = trainer.get("devices")
    if isinstance(devices, str) and re.fullmatch(r"-?\d+", devices.strip()):
        devices = int(devices)
    if _is_number(devices) and (devices == 0 or devices < -1):
        raise refuse("trainer.devices", devices, "must be ≥ 1 (devices per node), -1 (all) or auto", args,
                     "e.g. --trainer.devices 1")  # fmt: skip
    check_seed(config, args)
    every = config.get("checkpoint_every")
    if _is_number(every) and every < 1:
        raise refuse("checkpoint_every", every, "must be positive (an integer ≥ 1: rounds between checkpoints)", args,
                     "e.g. --checkpoint_every 10")  # fmt: skip
    wandb = config.get("wandb") or {}
    if "mode" in wandb and wandb["mode"] not in WANDB_MODES:
        raise refuse("wandb.mode", wandb["mode"], f"must be one of {', '.join(WANDB_MODES)}", args,
                     "e.g. --wandb.mode offline")  # fmt: skip
    bad_tags = [t for t in wandb.get("tags") or [] if not isinstance(t, str) or not 1 <= len(t) <= 64]
    if bad_tags:
        raise refuse("wandb.tags", bad_tags[0], "must be strings of 1 to 64 characters (W&B's limit)", args,
                     "drop or shorten that tag")  # fmt: skip
    project = wandb.get("project")
    if isinstance(project, str) and (not project or re.search(r"[/\\#?%:]", project)):
        raise refuse("wandb.project", project, "must be a non-empty name without / \\ # ? % :", args,
                     "e.g. --wandb.project fl_lightning (the entity: wandb login or WANDB_ENTITY)")  # fmt: skip
    if _is_number(wandb.get("histogram_every")) and wandb["histogram_every"] < 0:
        raise refuse("wandb.histogram_every", wandb["histogram_every"], "must be an integer ≥ 0 (0: never)", args)
    model = config.get("model")
    if isinstance(model, dict):
        for name, allowed in (("momentum", "must be ≥ 0"), ("weight_decay", "must be ≥ 0"),
                              ("eval_last", "must be an integer ≥ 0 (the last rounds evaluated every round)")):
            value = model.get(name)
            if _is_number(value) and not 0 <= value < math.inf:  # one key, its value and where it was set
                raise refuse(f"model.{name}", value, allowed, args)
        if model.get("compile") == "cudagraphs" and not cuda_for(trainer.get("accelerator")):
            raise refuse("model.compile", "cudagraphs", "captures CUDA graphs: it needs a CUDA device", args,
                         "use --model.compile compile (or none) on this machine")  # fmt: skip
        _walk(model, "model", "fl_lightning.engine.module.FederatedModule", args)
    _walk(config.get("data"), "data", None, args)


def cuda_for(accelerator: Any) -> bool:
    """Whether a trainer with ``accelerator`` trains on CUDA here (``auto``/None: when torch sees a GPU)."""
    import torch

    return str(accelerator) in ("gpu", "cuda", "auto", "None") and torch.cuda.is_available()


def check_seed(config: dict[str, Any], args: list[str]) -> None:
    """``seed_everything`` is one of numpy's seeds (LightningCLI seeds before the other checks run, with numpy's
    own line on a negative seed)."""
    seed = config.get("seed_everything")
    if _is_number(seed) and not 0 <= seed < 2**32:
        raise refuse("seed_everything", seed, "must be an integer in [0, 2**32)", args, "e.g. --seed_everything 0")


def run_dir_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` cannot hold a run (a file, not writable, …), as the start of one line; ``None`` if it can."""
    import os

    for folder in (run_dir, *run_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                what = "is" if folder == run_dir else f"is inside {folder}, which is"
                return f"--run_dir {run_dir} {what} a file, not a folder"
            if not os.access(folder, os.W_OK | os.X_OK):
                return f"--run_dir {run_dir}: {folder} is not writable (permission denied or a read-only file system)"
            break
    if run_dir.is_dir() and ((run_dir / "commands.sh").is_file() or next(run_dir.glob("*/**/run.json"), None)):
        return (f"--run_dir {run_dir} holds an experiment's runs in its subfolders (a run written there would hide "
                "them from compare)")
    created = [f for f in (run_dir, *run_dir.parents) if not f.exists()]  # made by the probe, removed after it
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return f"--run_dir {run_dir} cannot be written ({exc.strerror or exc})"
    finally:  # a refused command leaves no empty folder behind: the run creates its dir when it starts
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None
