"""A run's identity: its resolved config (what ``train.py --print_config`` prints) less what may change on resume.

Every place that must agree on what a run is derives it from here instead of listing keys of its own:

* the resume check (``fl_lightning.run_dir.check_same_run``): a resume is refused when its identity differs from the
  one in the run's ``config.yaml``;
* the batching key of the run axis (``fl_lightning.experiment.run_axis.identity.batch_key``): runs share a batched
  job only when their identities are equal except in the keys the run axis declares it carries per run;
* the record of what ran (``summary.json``'s ``ran``).

A key that a later change adds to the config is part of the identity without any edit here.
"""

from __future__ import annotations

import json
from typing import Any

#: what a resume may change: the length of the run, logging, W&B, callbacks (early stopping, extra checkpoints,
#: monitors) and where things are written (none of it changes the numbers of the rounds trained)
RESUME_MAY_CHANGE = ("trainer.max_steps", "trainer.max_time", "trainer.callbacks", "trainer.profiler",
                     "trainer.enable_progress_bar",
                     "trainer.enable_model_summary", "trainer.log_every_n_steps", "trainer.logger",
                     "trainer.default_root_dir", "trainer.enable_checkpointing", "ckpt_path", "run_dir", "config",
                     "checkpoint_every", "overwrite", "wandb", "print_config", "__path__")  # fmt: skip


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted.key: leaf}`` (``init_args`` levels left out of the names; lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = prefix if key == "init_args" else f"{prefix}.{key}" if prefix else str(key)
        out.update(flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return out


def under(key: str, prefixes: tuple[str, ...] | frozenset[str]) -> bool:
    """Whether ``key`` is one of ``prefixes`` or below one of them (``wandb.name`` is under ``wandb``)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The leaves of the resolved ``config`` that make the run what it is: all but :data:`RESUME_MAY_CHANGE`."""
    return {key: value for key, value in flatten(config).items() if not under(key, RESUME_MAY_CHANGE)}


def same_value(a: Any, b: Any) -> bool:
    """Equal leaves: ``1`` and ``1.0`` are one setting, and so are a tuple and the list a YAML file reads back."""
    return _plain(a) == _plain(b)


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def identity_differences(
    old: dict[str, Any], new: dict[str, Any], ignore: tuple[str, ...] = (), only_shared: bool = False
) -> list[str]:
    """``key old -> new`` for every identity leaf that differs between two resolved configs, in config order,
    leaving out ``ignore`` (and the keys below them). ``only_shared``: a key that one side lacks (an option added to
    the code since a run started) is not compared."""
    a, b = run_identity(old), run_identity(new)
    out = []
    for key in dict.fromkeys([*a, *b]):
        if under(key, ignore) or (only_shared and (key not in a or key not in b)):
            continue
        if key not in a or key not in b or not same_value(a[key], b[key]):
            out.append(f"{key} {_shown(a, key)} -> {_shown(b, key)}")
    return out


def _shown(leaves: dict[str, Any], key: str) -> str:
    return json.dumps(leaves[key], default=str) if key in leaves else "(unset)"
