"""Check every run of an experiment with ``train.py``'s own parser before any run starts.

Each run's argument list goes through the same LightningCLI parser as ``python train.py``, which stops right
after parsing (nothing is instantiated, no data is loaded). So an unknown key, a value of the wrong type or a
config file that does not parse is reported for the experiment, with the run and the key, before the first run
trains.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Any

from fl_lightning.errors import ConfigError, check_config_files, one_line
from fl_lightning.experiment.spec import Experiment, ExperimentError, RunSpec


class _Parsed(Exception):
    """Raised right after parsing to stop LightningCLI before it instantiates anything."""

    def __init__(self, config: Any) -> None:
        super().__init__("parsed")
        self.config = config


def parse_train_args(args: list[str]) -> dict[str, Any]:
    """``train.py args`` parsed (not run): the full resolved config as a plain dict; :class:`ConfigError` on a
    bad argument."""
    from jsonargparse import ArgumentError

    from datamodules.base import FederatedDataModule
    from fl_lightning import cli
    from fl_lightning.engine.module import FederatedModule

    check_config_files(args)

    class ParseOnly(cli._make_cli_class("fit", args)):
        def before_instantiate_classes(self) -> None:
            from fl_lightning.config_checks import check_ranges

            check_ranges(self.config.as_dict(), args)
            raise _Parsed(self.config)

    argv, sys.argv = sys.argv, sys.argv[:1]
    logging.disable(logging.INFO)  # "Seed set to 0" and other notes of a run that does not happen
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ParseOnly(
                FederatedModule,
                FederatedDataModule,
                subclass_mode_data=True,
                run=False,
                args=args,
                trainer_defaults=cli.TRAINER_DEFAULTS,
                seed_everything_default=0,
                auto_configure_optimizers=False,
                parser_kwargs={"exit_on_error": False},
            )
    except _Parsed as done:
        return done.config.as_dict()
    except ConfigError:
        raise
    except (ArgumentError, TypeError, ValueError) as exc:
        from fl_lightning.config_checks import locate

        raise ConfigError(locate(one_line(exc), args)) from None
    finally:
        sys.argv = argv
        logging.disable(logging.NOTSET)
    raise RuntimeError("LightningCLI returned without parsing")  # pragma: no cover


#: ``train.py`` arguments that only name or seed a run: runs that differ in nothing else parse to the same config
#: but for the seed (``naming_free``)
NAMING = ("--seed_everything", "--run_dir", "--wandb.name", "--wandb.group", "--wandb.tags", "--wandb.job_type")


def naming_free(args: list[str]) -> tuple[str, ...]:
    """``args`` without its ``NAMING`` arguments, in either form (``--run_dir=DIR`` or ``--run_dir DIR``): the
    key under which runs of one grid share a parse."""
    key, skip = [], False
    for a in args:
        if skip or a.split("=", 1)[0] in NAMING:
            skip = not skip and "=" not in a  # "--run_dir DIR": drop the value too
            continue
        key.append(a)
    return tuple(key)


def validate_runs(experiment: Experiment, runs: list[RunSpec]) -> dict[str, dict[str, Any]]:
    """Parse every run (runs that differ only in their seed are parsed once, with a seed check); returns the
    resolved config of each run keyed by its run dir. The first problem is an :class:`ExperimentError`."""
    resolved: dict[str, dict[str, Any]] = {}
    cache: dict[tuple[str, ...], dict[str, Any]] = {}
    for run in runs:
        args = run.args()
        key = naming_free(args)
        if key not in cache:
            try:
                cache[key] = parse_train_args(args)
            except ConfigError as exc:
                where = ", ".join(f"{a}={label}" for a, label in run.labels.items()) or "the run"
                raise ExperimentError(f"{experiment.source}: {where}: {exc}") from None
        config = dict(cache[key])
        if run.seed is not None:
            config["seed_everything"] = run.seed
        resolved[str(run.run_dir)] = config
    return resolved
