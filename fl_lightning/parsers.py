"""train.py's parser, built once per process and reused by the runs that follow (the experiment runner's runs, a
batched job's threads, the tests), and ``config.yaml`` written from the one dump of a run's resolved config.

A LightningCLI builds its jsonargparse parser from the model, data and trainer classes (about a third of a run's
set-up on the digits configs). ``FederatedCLI`` takes an idle parser built for the same key (``parser_key``) and gives
it back when its set-up ends; a parser is used by one CLI at a time (two runs set up at once build two). Like
``fl_lightning.cli``, this module imports only the standard library.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

#: parsers built by ``FederatedCLI`` and not in use, per construction key (``parser_key``): a process that runs
#: several runs (the experiment runner, a batched job's threads, the tests) builds train.py's parser once per kind
_IDLE_PARSERS: dict[tuple[Any, ...], list[Any]] = {}

#: the methods that build a LightningCLI's parser: a subclass that overrides one of them builds another parser
_PARSER_BUILDERS = (
    "init_parser",
    "add_default_arguments_to_parser",
    "add_core_arguments_to_parser",
    "add_arguments_to_parser",
    "link_optimizers_and_lr_schedulers",
)


def parser_key(cli: Any, main_kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a LightningCLI's parser (``run=False``) is built from: the classes, the trainer defaults, the seed default,
    the parser's arguments and the code of the methods that add arguments (with what their closures hold, by
    identity). ``None`` (build afresh) where a part has no stable representation."""
    builders = []
    for name in _PARSER_BUILDERS:
        fn = getattr(type(cli), name)
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        cells = tuple(id(c.cell_contents) for c in fn.__closure__ or ())
        builders.append((code, cells))
    return (
        cli.parser_class, cli.trainer_class, cli._model_class, cli._datamodule_class, cli.model_class is None,
        cli.datamodule_class is None, cli.subclass_mode_model, cli.subclass_mode_data, cli.auto_configure_optimizers,
        repr(cli.trainer_defaults), repr(cli.seed_everything_default), repr(sorted(main_kwargs.items())),
        tuple(builders),
    )  # fmt: skip


def take_parser(key: tuple[Any, ...] | None) -> Any:
    """An idle parser built for ``key``, now in use by the caller alone, or None."""
    idle = _IDLE_PARSERS.get(key) if key is not None else None
    try:
        return idle.pop() if idle else None
    except IndexError:  # another thread took the last one meanwhile
        return None


def construct(class_type: type, *args: Any, **kwargs: Any) -> Any:
    """jsonargparse's default instantiation: the class called with its arguments."""
    return class_type(*args, **kwargs)


def give_back_parser(key: tuple[Any, ...] | None, parser: Any, instantiated: Sequence[tuple[type, bool]] = ()) -> None:
    """``parser`` is idle again. LightningCLI registered on it, for each ``(class, subclasses)`` of ``instantiated``,
    an instantiator that holds the CLI (its model, data and trainer): replaced by a plain one, so that an idle parser
    keeps no run alive (the next CLI registers its own again)."""
    if key is None or parser is None:
        return
    with warnings.catch_warnings():  # deprecated in jsonargparse 4.49, which LightningCLI 2.6 calls on every run
        warnings.simplefilter("ignore")
        for class_type, subclasses in instantiated:
            parser.add_instantiator(construct, class_type, subclasses=subclasses)
    _IDLE_PARSERS.setdefault(key, []).append(parser)


class DumpedConfig:
    """Stands for the parser in Lightning's ``SaveConfigCallback``: it writes ``config.yaml`` from the text the run
    dumped once when it was instantiated (``FederatedCLI._dump_config``), so the parser is no longer needed when
    the run starts (it serves the next run) and the config is not dumped a second time."""

    def __init__(self, text: str) -> None:
        self.text = text

    def save(self, config: Any, path: str, skip_none: bool = False, overwrite: bool = False, **_: Any) -> None:
        if not overwrite and os.path.isfile(path):
            raise ValueError(f"Refusing to overwrite existing file: {path}")
        with open(path, "w") as f:
            f.write(self.text)
