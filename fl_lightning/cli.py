"""The command line: ``python train.py [fit|validate|test] --config configs/x.yaml [--a.b value] [--ckpt_path P]``.

LightningCLI (``run=False``) parses the YAML into a ``FederatedModule`` and a ``FederatedDataModule``.
This wrapper adds the subcommands (``fit`` is the default, so ``train.py --config X`` trains), the run
directory, the loggers (CSV always, W&B offline unless you are logged in), round checkpoints, a quiet
console, one-line errors for bad configs and data (exit code 2), and the result table.

This module imports only the standard library at the top, so ``train.py --help`` answers without loading
torch or Lightning; everything heavy is imported where it is used.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fl_lightning.errors import ConfigError, check_config_files, one_line
from fl_lightning.parsers import DumpedConfig, give_back_parser, parser_key, take_parser
from fl_lightning.run_dir import RunFinished, before_the_end, clear_planned, default_run_dir, plan_run_dir, resolve_ckpt

SUBCOMMANDS = ("fit", "validate", "test")

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 100,
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    "val_check_interval": 1,  # rounds between evaluations of every client (a run is one epoch of rounds)
    "check_val_every_n_epoch": None,
    "use_distributed_sampler": False,
    "enable_model_summary": False,
}

USAGE = """\
usage: python train.py [fit | validate | test] --config CONFIG.yaml [--config MORE.yaml] [--key.subkey VALUE ...]

Federated learning runs on PyTorch Lightning, configured by YAML files (LightningCLI).

subcommands:
  fit (default)   train; every trainer.val_check_interval rounds (and in each of the last model.eval_last
                  rounds) every client evaluates its own model on its own test split
  validate        evaluate a checkpoint on every client's test split (needs --ckpt_path)
  test            evaluate a checkpoint on the test split and on held-out new clients where the data has
                  them, with "+FT" if model.finetune is set (needs --ckpt_path)

common options:
  --config FILE           a YAML config; repeat it to combine files (later files win)
  --ckpt_path PATH|last   fit: resume from it; validate/test: the checkpoint to evaluate
                          ('last' = the newest loadable checkpoint of the run directory)
  --run_dir DIR           output folder (default: runs/<config file names>)
  --overwrite true        fit: start the run in --run_dir again (its old files are removed)
  --checkpoint_every N    fit: save a checkpoint every N rounds (default 10)
  --wandb.mode MODE       auto | online | offline | disabled (auto: online when logged in, else offline)
  --print_config          print the resolved config and exit
  --trainer.max_steps N   the number of communication rounds; every trainer.*, model.* and data.* option
                          is set the same way (e.g. --model.lr 0.05, --trainer.val_check_interval 5)

every option with its type and default:  python train.py fit --help   (loads torch and Lightning)
"""


@dataclass
class WandbOptions:
    """W&B settings. ``mode``: online, offline or disabled; ``auto`` is online when an API key is
    configured and offline otherwise (``wandb sync`` uploads offline runs later)."""

    project: str = "fl_lightning"
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str = "auto"
    job_type: str | None = None
    histogram_every: int = 10  #: a histogram of the per-client accuracies every N evaluations (0: never)


def wandb_logged_in() -> bool:
    """Whether W&B has credentials: ``WANDB_API_KEY`` or an ``api.wandb.ai`` entry in ``~/.netrc`` (``wandb login``)."""
    netrc = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        in_netrc = netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    except OSError:
        in_netrc = False
    return bool(os.environ.get("WANDB_API_KEY")) or in_netrc


def _wandb_mode(requested: str) -> str:
    """The W&B mode of a run: an explicit ``--wandb.mode`` (online, offline, disabled) wins; ``auto`` follows
    ``WANDB_MODE`` when it is set, else online when logged in and offline otherwise."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if wandb_logged_in() else "offline"


def check_wandb(requested: str) -> None:
    """``--wandb.mode online`` without credentials: one line, before W&B starts (it would ask on the terminal or
    fail with a traceback)."""
    if _wandb_mode(requested) == "online" and not wandb_logged_in():
        source = "--wandb.mode online" if requested == "online" else "WANDB_MODE=online"
        raise ConfigError(
            f"{source}: no W&B credentials (no WANDB_API_KEY, no api.wandb.ai in ~/.netrc); fix: run `wandb login` "
            "or set WANDB_API_KEY, or use --wandb.mode offline (upload later with wandb sync)"
        )


def make_loggers(
    run_dir: Path, wandb: WandbOptions, config: dict[str, Any], stage: str = "fit", resume: bool = False
) -> list[Any]:
    """CSV (``run_dir/metrics.csv``, extended by a resumed fit; ``run_dir/<stage>/`` for validate and test, so
    that a training run's metrics are never overwritten) and W&B (a resumed fit continues the W&B run whose id is
    stored in the run dir; a ``validate``/``test`` run is its own W&B run, same group)."""
    from lightning.pytorch.loggers import CSVLogger

    from fl_lightning.loggers import ResumableCSVLogger, wandb_run_id

    if stage == "fit":
        loggers: list[Any] = [ResumableCSVLogger(save_dir=str(run_dir), resume=resume)]
    else:
        loggers = [CSVLogger(save_dir=str(run_dir), name="", version=stage)]
    mode = _wandb_mode(wandb.mode)
    if mode != "disabled":
        from lightning.pytorch.loggers import WandbLogger

        name = wandb.name or run_dir.name
        shown = name if stage == "fit" else f"{name}-{stage}"
        settings = dict(project=wandb.project, group=wandb.group, name=shown, tags=list(wandb.tags), mode=mode)
        from fl_lightning.loggers import wandb_banner_silenced

        if wandb_banner_silenced():  # W&B's banner and footer: the run's end says where its W&B run is instead
            import wandb as wandb_module

            settings["settings"] = wandb_module.Settings(silent=True)
        if stage == "fit" and resume and mode == "offline":
            from fl_lightning.loggers import continuing_wandb_logger

            run_id = wandb_run_id(run_dir, resume)
            logger = continuing_wandb_logger(run_dir, run_id, job_type=wandb.job_type, **settings)
        else:
            extra = {"id": wandb_run_id(run_dir, resume), "resume": "allow"} if stage == "fit" else {"job_type": stage}
            logger = WandbLogger(save_dir=str(run_dir), **{"job_type": wandb.job_type, **extra}, **settings)
        logger._wandb_init.pop("anonymous", None)  # W&B warns on every run that the setting has no effect
        try:
            logger.log_hyperparams(config)  # starts the W&B run
        except Exception as exc:  # W&B's own checks (pydantic Settings, UsageError): one line naming the option
            raise ConfigError(wandb_problem(exc)) from None
        loggers.append(logger)
    return loggers


def wandb_problem(exc: BaseException) -> str:
    """W&B's refusal to start (``1 validation error for Settings`` over several lines, a ``UsageError``) as one
    line that names the ``wandb.*`` option."""
    import re

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith("For further")]
    field = next((ln for ln in lines[1:2] if re.fullmatch(r"\w+", ln)), "")
    options = {"run_tags": "wandb.tags", "project": "wandb.project", "run_group": "wandb.group",
               "run_name": "wandb.name", "run_job_type": "wandb.job_type", "mode": "wandb.mode"}  # fmt: skip
    option = options.get(field, "wandb")
    detail = re.sub(r"\s*\[type=.*$", "", lines[2] if field and len(lines) > 2 else (lines or [type(exc).__name__])[0])
    if "project name" in detail:
        option = "wandb.project"
    return f"{option}: W&B refuses it: {detail.removeprefix('Value error, ')}; fix: change --{option}"


def _make_cli_class(stage: str = "fit", args: Sequence[str] = ()):
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
    from lightning.pytorch.cli import LightningCLI

    from fl_lightning.callbacks import RoundCheckpoint
    from fl_lightning.config_checks import run_dir_problem
    from fl_lightning.engine.module import FP16_REFUSED
    from fl_lightning.loggers import is_launching_process
    from fl_lightning.progress import round_progress

    class FederatedCLI(LightningCLI):
        def __init__(self, *cli_args: Any, **cli_kwargs: Any) -> None:
            self._parser_key = None
            try:
                super().__init__(*cli_args, **cli_kwargs)
            finally:  # the run no longer needs its parser (config.yaml's text is dumped): the next run takes it
                built = [(self._model_class, self.subclass_mode_model)]
                built.append((self._datamodule_class, self.subclass_mode_data))
                give_back_parser(self._parser_key, getattr(self, "parser", None), built)

        def setup_parser(
            self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
        ) -> None:
            """Lightning's parser, built once per process and kind (``parser_key``) and reused by later runs."""
            key = None if add_subcommands else parser_key(self, main_kwargs)
            parser = take_parser(key)
            if parser is None:
                super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            else:
                self.parser = parser
            self._parser_key = key

        def _dump_config(self) -> None:
            """The resolved config dumped once per run (Lightning dumps it for the checkpoints' hyper-parameters,
            this CLI for the run's full config, ``SaveConfigCallback`` for ``config.yaml``: three validated dumps):
            ``config_text`` is ``config.yaml``, ``config_dump`` Lightning's hyper-parameters (that YAML read back,
            as Lightning does; the parser has no link targets to keep) and ``full_config`` the JSON-typed copy that
            W&B and the resume check read. The dump does not validate the config again: parsing just did, and what
            changed since is this CLI's own (the seed drawn, the sizes taken from the data)."""
            if hasattr(self, "config_dump"):
                return
            import yaml

            self.config_text = self.parser.dump(self.config, skip_none=False, skip_validation=True)
            self.config_dump = yaml.load(self.config_text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            self.full_config = json.loads(json.dumps(self.config_dump))

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument(
                "--run_dir", type=str | None, default=None, help="Output folder (default runs/<config>)."
            )
            parser.add_argument(
                "--ckpt_path",
                type=str | None,
                default=None,
                help="fit: checkpoint to resume; validate/test: checkpoint to evaluate ('last': the run's newest).",
            )
            parser.add_argument("--checkpoint_every", type=int, default=10, help="Save a checkpoint every N rounds.")
            parser.add_argument("--wandb", type=WandbOptions, default=WandbOptions())
            parser.add_argument(
                "--overwrite", type=bool, default=False, help="fit: true replaces the run in --run_dir."
            )
            parser.add_argument(
                "--tf32", type=bool, default=True, help="float32 matmuls/convolutions on CUDA use TF32 (set_tf32)."
            )

        def _set_seed(self) -> None:
            from fl_lightning.config_checks import check_seed

            check_seed({"seed_everything": self.config.get("seed_everything")}, list(args))
            super()._set_seed()

        def before_instantiate_classes(self) -> None:
            from fl_lightning.config_checks import check_ranges
            from fl_lightning.sizes import share_sizes  # issue 18: network sizes come from the data

            check_ranges(self.config.as_dict(), list(args))
            share_sizes(self.config)

        def instantiate_trainer(self, **kwargs: Any):
            cfg = self.config
            if stage != "fit" and not cfg.ckpt_path:
                raise ConfigError(f"{stage} needs a checkpoint: --ckpt_path PATH (or 'last' for the run directory's)")
            trainer_cfg = self._get(self.config_init, "trainer", default={})
            set_tf32(cfg.tf32)
            kwargs.update(validation_schedule(trainer_cfg, cfg.model.eval_every))
            kwargs.update(distributed_strategy(trainer_cfg))
            if str(trainer_cfg.get("precision")) in ("16", "16-mixed"):
                raise ConfigError(FP16_REFUSED)
            check_accelerator(trainer_cfg.get("accelerator"))
            run_dir = Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg)
            trial = bool(trainer_cfg.get("fast_dev_run"))  # writes nothing into the run dir
            problem = run_dir_problem(run_dir)
            if problem:
                raise ConfigError(f"{problem}; fix: pick another --run_dir")
            self._dump_config()
            full_config = self.full_config
            self.ckpt_path, self.clear_first = cfg.ckpt_path, None
            if stage == "fit" and not trial and is_launching_process():  # DDP workers start after this check
                self.ckpt_path, self.clear_first = plan_run_dir(
                    run_dir, cfg.ckpt_path, cfg.overwrite, trainer_cfg.get("max_steps"), full_config
                )
            elif stage == "fit" and not is_launching_process() and cfg.ckpt_path == "last":
                if not any((run_dir / "checkpoints").glob("*.ckpt")):  # the launching process found nothing to
                    self.ckpt_path = None  # resume in a dir left before its first checkpoint and started afresh
            if stage == "fit" and self.ckpt_path:
                self.save_config_callback = None  # config.yaml records what trained the first rounds: kept
            elif self.save_config_callback is not None:
                save_config, text = self.save_config_callback, self.config_text
                self.save_config_callback = lambda parser, config, **kw: save_config(DumpedConfig(text), config, **kw)
            self.run_dir = run_dir
            if not trial and trainer_cfg.get("logger") in (None, True):
                check_wandb(cfg.wandb.mode)
            # the loggers (W&B starts a run and writes into the run dir) are made by ``start_run`` once every
            # check has passed: a refused command leaves no W&B run and no file behind
            self.pending_loggers = None
            if trial:
                kwargs["logger"] = False
            elif trainer_cfg.get("logger") in (None, True):
                kwargs["logger"] = False
                self.pending_loggers = (run_dir, cfg.wandb, full_config, stage)
            kwargs["default_root_dir"] = str(run_dir)
            callbacks = list(trainer_cfg.get("callbacks") or [])
            user_last = any(isinstance(c, ModelCheckpoint) and c.save_last for c in callbacks)
            # fast_dev_run writes nothing: no round checkpoints (Lightning's own checkpoints skip saving in it)
            if not trial and trainer_cfg.get("enable_checkpointing", True) is not False and not any(
                isinstance(c, RoundCheckpoint) for c in callbacks
            ):
                callbacks.append(
                    RoundCheckpoint(
                        dirpath=str(run_dir / "checkpoints"),
                        filename="round{step:05d}",
                        auto_insert_metric_name=False,
                        every_n_train_steps=cfg.checkpoint_every,
                        save_top_k=2,
                        monitor="step",
                        mode="max",
                        save_last=not user_last,
                    )
                )
            if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
                isinstance(c, ProgressBar) for c in callbacks
            ):
                callbacks.append(round_progress())
            if cfg.wandb.histogram_every > 0 and _wandb_mode(cfg.wandb.mode) != "disabled":
                from fl_lightning.loggers import client_histogram_callback

                callbacks.append(client_histogram_callback(cfg.wandb.histogram_every))
            kwargs["callbacks"] = callbacks
            trainer = super().instantiate_trainer(**kwargs)
            if trainer_cfg.get("logger") not in (None, True, False):  # loggers from --trainer.logger
                from fl_lightning.loggers import wandb_loggers

                for logger in wandb_loggers(trainer.loggers):
                    logger.log_hyperparams(full_config)  # the full resolved config, not only the module's
            return trainer

    return FederatedCLI


def set_tf32(enabled: bool) -> None:
    """The one TF32 policy of every run (``train.py`` and the experiment runner, in process or in workers: both go
    through ``run``): float32 matrix products, convolutions and LSTMs on CUDA use TF32 tensor cores when ``enabled``
    (``--tf32``, default true, recorded in the run's config), IEEE float32 otherwise. CPU math is left alone."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = enabled  # (torch.get_float32_matmul_precision: "high" / "highest")
    torch.backends.cudnn.allow_tf32 = enabled


def check_accelerator(accelerator: Any) -> None:
    """``trainer.accelerator gpu`` (or ``cuda``) on a machine where torch sees no GPU: one line with the fix (Lightning
    says only "No supported gpu backend found!")."""
    import torch

    if str(accelerator) not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    if str(accelerator) == "gpu" and torch.backends.mps.is_available():
        return
    raise ConfigError(
        f"trainer.accelerator {accelerator}: torch sees no GPU on this machine (torch.cuda.is_available() is False); "
        "fix: --trainer.accelerator cpu, or auto (the GPU when there is one)"
    )


def quiet_third_party() -> None:
    """Silence the warnings of Lightning and torch that a user cannot act on (issue 45): a resume's "Checkpoint
    directory … exists and is not empty" (the run dir holds its own checkpoints by design), the request to pass the
    callbacks that wrote the checkpoint (``RoundCheckpoint`` is always there; its interval may change on resume),
    and ``torch.load``'s ``weights_only`` notices (the CLI loads checkpoints with ``weights_only=True`` itself)."""
    import warnings

    for pattern in (
        r"Checkpoint directory .* exists and is not empty",
        r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
        r".*weights_only",
        r"`broadcast_buffers` is deprecated",  # DDP: kept on purpose (as the warning says, for rank-local buffers)
        r"torch.distributed.nn.functional.all_gather is deprecated",  # inside Lightning's all_gather
    ):
        warnings.filterwarnings("ignore", message=pattern)


def distributed_strategy(trainer_cfg: dict[str, Any]) -> dict[str, Any]:
    """``strategy: ddp`` as DDP without the buffer broadcast at every forward: every rank keeps the model's buffers
    and the client bank identical by construction (the same reduced update, the same gathered rows)."""
    if trainer_cfg.get("strategy") != "ddp":
        return {}
    from lightning.pytorch.strategies import DDPStrategy

    return {"strategy": DDPStrategy(broadcast_buffers=False)}


def validation_schedule(trainer_cfg: dict[str, Any], eval_every: int | None) -> dict[str, Any]:
    """Trainer settings for evaluating every N rounds. ``model.eval_every`` is the old name of
    ``trainer.val_check_interval``; a run is one epoch, so a fraction of it needs ``check_val_every_n_epoch=1``."""
    interval = trainer_cfg.get("val_check_interval")
    if eval_every is not None:
        if interval not in (None, 1, eval_every):
            raise ConfigError(
                f"model.eval_every={eval_every} and trainer.val_check_interval={interval} disagree; "
                "set only trainer.val_check_interval (model.eval_every is its old name)"
            )
        return {"val_check_interval": eval_every, "check_val_every_n_epoch": None}
    if isinstance(interval, float) and trainer_cfg.get("check_val_every_n_epoch") is None:
        return {"check_val_every_n_epoch": 1}
    return {}


def split_subcommand(args: list[str]) -> tuple[str, list[str]]:
    """``[fit|validate|test] rest…`` → (subcommand, rest); no subcommand means ``fit``."""
    if args and args[0] in SUBCOMMANDS:
        return args[0], args[1:]
    return "fit", args


class _DropNoise:
    """A logging filter for Lightning's informational lines that say nothing about this run."""

    NOISE = (
        "💡 Tip:",
        "TPU available: False",
        "HPU available: False",
        "GPU available: False",
        "`Trainer(val_check_interval=1)` was configured",
        "Seed set to",
        "`Trainer.fit` stopped:",  # the run's own table and "run: DIR" say that it ended
        "Restored all states from the checkpoint",  # "Restoring states from … PATH" already names it
        "Loaded model weights from the checkpoint",
    )

    def filter(self, record: Any) -> bool:
        message = re.sub(r"^\[rank: \d+\] ", "", str(record.getMessage()))  # a DDP worker's lines carry its rank
        return not message.startswith(self.NOISE)


class CurrentStderr(logging.StreamHandler):
    """A console handler that writes to ``sys.stderr`` as it is when a record comes, not as it was when the handler
    was made: each run of a process (the experiment runner's runs, the run axis' threads) prints its lines to its
    own log, first run or last."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler sets it once; the current sys.stderr is read instead
        pass


def quiet_console() -> None:
    """Silence what a normal run would print that is not about the user's config: Lightning's product tips,
    a deprecation inside Lightning, the manual-optimisation checkpoint lecture (the post-step state is the
    right state for a round), and 'not available' device lines."""
    import warnings

    for pattern in (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"Using ModelCheckpoint with manual optimization",
        r"LightningCLI's args parameter is intended",  # we pass the arguments without the subcommand
        r"It is recommended to use `self.log\('(val|test|round)",  # already summed over ranks (torchmetrics)
    ):
        warnings.filterwarnings("ignore", message=pattern)
    import lightning.pytorch  # noqa: F401 - Lightning gives its loggers their console handlers when imported

    engine_log = logging.getLogger("fl_lightning")  # the engine's choices (executor: …) and warnings, one line each
    if not any(isinstance(h, CurrentStderr) for h in engine_log.handlers):
        console = CurrentStderr()
        console.setFormatter(logging.Formatter("%(message)s"))
        engine_log.addHandler(console)
        engine_log.setLevel(logging.INFO)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropNoise) for f in handler.filters):
                handler.addFilter(_DropNoise())


def check_checkpoint_fits(module: Any, datamodule: Any, path: str) -> None:
    """A checkpoint of another algorithm, network or number of clients: one line naming the difference."""
    import torch

    from fl_lightning.engine.checkpoint import checkpoint_mismatch

    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    module.attach_data(datamodule.federated)
    problem = checkpoint_mismatch(module, checkpoint)
    if problem:
        raise ConfigError(f"--ckpt_path {path}: {problem}")


def make_cli(stage: str, args: list[str]) -> Any:
    """train.py's LightningCLI of ``stage`` (``fit``, ``validate``, ``test``) for ``args``: parsed, checked and
    instantiated (model, data, trainer); nothing is run or written yet (``run`` does that)."""
    from datamodules.base import FederatedDataModule
    from fl_lightning.engine.module import FederatedModule

    return _make_cli_class(stage, args)(
        FederatedModule,
        FederatedDataModule,
        subclass_mode_data=True,
        run=False,
        args=args,
        trainer_defaults=TRAINER_DEFAULTS,
        auto_configure_optimizers=False,
        parser_kwargs={"exit_on_error": False},
        save_config_kwargs={"overwrite": True},
    )


def run(args: list[str] | None = None, before_fit: Any = None) -> dict[str, Any]:
    """Parse; fit (print the result table, return the run summary) or validate/test a checkpoint (print and
    return its metrics). ``before_fit(cli)`` is called right before training (``fl_lightning.experiment.run_axis``)."""
    stage, args = split_subcommand(list(sys.argv[1:] if args is None else args))
    check_config_files(args)
    from jsonargparse import ArgumentError
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    quiet_console()
    quiet_third_party()
    try:
        cli = make_cli(stage, args)
    except ConfigError:
        raise
    except ArgumentError as exc:
        from fl_lightning.config_checks import locate

        raise ConfigError(locate(one_line(exc), args)) from None
    except RunFinished as done:
        print(f"{done.run_dir} is finished ({done.summary.get('rounds')} rounds, summary.json): nothing to resume; "
              "--overwrite true trains it again")  # fmt: skip
        return done.summary
    except (TypeError, ValueError, KeyError, MisconfigurationException) as exc:  # constructors' or Lightning's checks
        raise ConfigError(one_line(exc)) from None
    cli.datamodule.trainer = cli.trainer  # the data checks know whether the run evaluates
    cli.datamodule.setup(stage)  # surface data errors before Lightning starts
    ckpt = resolve_ckpt(cli.ckpt_path, cli.run_dir)
    if stage == "fit" and cli.ckpt_path == "last" and ckpt is not None and not (cli.run_dir / "summary.json").is_file():
        ckpt = before_the_end(ckpt, cli.run_dir, cli.trainer.max_steps)
    if ckpt is not None:
        check_checkpoint_fits(cli.model, cli.datamodule, ckpt)
    preflight(cli)
    start_run(cli, resume=bool(cli.ckpt_path))
    try:
        if stage == "fit":
            if before_fit is not None:
                before_fit(cli)
            return _fit(cli, ckpt)
        return _evaluate(cli, stage, ckpt)
    except MisconfigurationException as exc:
        raise ConfigError(one_line(exc)) from None


def preflight(cli: Any) -> None:
    """The checks that the module's ``setup`` would make at the start of fit/validate/test, made before anything
    is written: the algorithm against the network and the data, DP's refusals (``model.privacy`` needs uniform
    aggregation, parameters only, …) and its ``target_epsilon`` calibration for the planned rounds."""
    module, datamodule = cli.model, cli.datamodule
    fresh = module.bank is None  # (a checkpoint's check may have built it already)
    module.attach_data(datamodule.federated)  # idempotent: fit's setup binds the same data again
    if module.privacy is not None:
        module.privacy.setup(cli.trainer, datamodule)
    if fresh:  # built again at setup, where the trainer places it (client_state: disk lives in the run dir)
        module.bank = None


def start_run(cli: Any, resume: bool) -> None:
    """Every check has passed: clear the run dir where ``--overwrite`` (or a stale run) asks for it, then make the
    loggers (the CSV log; W&B starts its run and writes ``wandb_id``) and hand them to the trainer."""
    clear_planned(cli.run_dir, getattr(cli, "clear_first", None))
    pending = getattr(cli, "pending_loggers", None)
    if pending is not None:
        run_dir, wandb, config, stage = pending
        cli.trainer.loggers = make_loggers(run_dir, wandb, config, stage, resume=resume and stage == "fit")


def _fit(cli: Any, ckpt: str | None) -> dict[str, Any]:
    """Train; at the end (only when the last round was reached) write ``summary.json`` whole, ``history.json`` and
    ``clients.csv``, and send the summary and the per-client table to W&B. ``fast_dev_run`` writes nothing."""
    from fl_lightning.engine.summary import what_ran
    from fl_lightning.loggers import log_run_end, write_clients_csv
    from fl_lightning.results import summary_table

    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
    summary = dict(cli.model.summary)
    trial = bool(cli.trainer.fast_dev_run)
    if cli.trainer.is_global_zero and summary:
        print()
        print(summary_table([summary]))
        summary["ran"] = what_ran(cli.model)  # the path and the batched job, in summary.json and W&B's config
        clients = cli.model.final_clients.rows() if cli.model.final_clients is not None else None
        stopped_early = cli.model.rounds_trained < cli.trainer.max_steps  # EarlyStopping, max_time, …
        if stopped_early:
            summary["stopped_early"] = True
        where: list[str] = []
        if not trial and cli.trainer.state.status == "finished":  # not after an exception or an interrupt
            (cli.run_dir / "history.json").write_text(json.dumps(cli.model.history, indent=1))
            if clients:
                write_clients_csv(cli.run_dir / "clients.csv", clients)
            where = log_run_end(cli.trainer.loggers, summary, clients)
            (cli.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))  # last: marks the run finished
        print(f"run: {cli.run_dir}" if not trial else "fast_dev_run: nothing written")
        for line in where:  # where the W&B run is (W&B's own footer is silenced)
            print(line)
    return summary


def _evaluate(cli: Any, stage: str, ckpt: str) -> dict[str, Any]:
    """``validate`` or ``test`` the checkpoint; writes ``run_dir/<stage>.json``."""
    evaluate = cli.trainer.validate if stage == "validate" else cli.trainer.test
    logged = evaluate(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt, verbose=False)
    result: dict[str, Any] = {k: float(v) for k, v in (logged[0] if logged else {}).items()}
    result = {"stage": stage, "checkpoint": ckpt, **result, "round": cli.model.rounds_trained - 1}
    if cli.trainer.is_global_zero:
        from fl_lightning.results import summary_cell

        width = max(len(k) for k in result)
        print("\n".join(f"{k.ljust(width)}  {summary_cell(v)}" for k, v in result.items()))
        path = cli.run_dir / f"{stage}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"{stage}: {path}")
        from fl_lightning.loggers import finish_wandb

        for line in finish_wandb(cli.trainer.loggers):
            print(line)
    return result


def train_config(configs: Sequence[str], overrides: Sequence[str] = (), run_dir: Path | None = None) -> dict[str, Any]:
    """Run ``train.py --config A --config B … overrides`` in this process; returns the run summary."""
    os.environ.setdefault("WANDB_MODE", "disabled")
    args: list[str] = []
    for c in configs:
        args += ["--config", str(c)]
    args += ["--trainer.enable_progress_bar", "false"]
    if run_dir is not None:
        args += ["--run_dir", str(run_dir)]
    args += list(overrides)
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both args and sys.argv are given
    try:
        return run(args)
    finally:
        sys.argv = argv


def main(args: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if args is None else args)
    if argv in (["-h"], ["--help"]):  # the overview, without loading torch or Lightning
        print(USAGE, end="")
        return 0
    if not argv:
        print(USAGE, end="", file=sys.stderr)
        return 2
    from fl_lightning.engine.module import TrainingDiverged

    try:
        run(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the environment: a full disk, a folder that vanished, …
        print(f"error: {exc.strerror or exc}: {exc.filename or ''} (a problem of the machine, not of the config)",
              file=sys.stderr)  # fmt: skip
        return 2
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
