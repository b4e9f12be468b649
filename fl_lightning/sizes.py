"""One source of truth for sizes shared by the data and the network (issue 18).

A network class lists, in ``data_sizes``, which of its arguments equal a data-module argument
(``LinearRepresentation.data_sizes = {"dim": "dim", "rank": "rank"}``). Before LightningCLI instantiates the
classes, :func:`share_sizes` fills every such network argument left unset (``None``) from the data module's value,
and turns a different explicit value into a one-line ``ConfigError``. Arguments in the class's
``data_defaults_only`` are only filled in, never checked (e.g. the factorisation rank of ``LowRankFactors`` may
differ from the rank of the synthetic matrix). So a dimension is set once, in ``data``, and reaches both.

(LightningCLI's ``link_arguments`` would also carry the value, but it silently overrides an explicit network value;
this keeps explicit values and reports a contradiction instead.)
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from fl_lightning.config_checks import init_default
from fl_lightning.errors import ConfigError


def _import(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _data_value(data: Any, key: str) -> Any:
    """The data module's value for ``key``: given in the config, else its signature default."""
    args = data.get("init_args") or {}
    if key in args:
        return args[key]
    cls = _import(str(data.get("class_path", "")))
    if cls is None:
        return None
    default = init_default(cls, key)
    return None if default is inspect.Parameter.empty else default


def share_sizes(config: Any) -> None:
    """Fill and check ``model.network.init_args`` against ``data.init_args`` in a parsed LightningCLI config."""
    network, data = config.get("model.network"), config.get("data")
    if network is None or data is None or not network.get("class_path"):
        return
    cls = _import(str(network["class_path"]))
    sizes: dict[str, str] = getattr(cls, "data_sizes", {}) if cls is not None else {}
    defaults_only = getattr(cls, "data_defaults_only", frozenset())
    for net_key, data_key in sizes.items():
        value = _data_value(data, data_key)
        if value is None:
            continue
        current = network["init_args"].get(net_key)
        if current is None:
            network["init_args"][net_key] = value
        elif current != value and net_key not in defaults_only:
            raise ConfigError(
                f"model.network.init_args.{net_key}={current} but data.init_args.{data_key}={value}: "
                f"set it once, in data (the network takes it from there)"
            )
