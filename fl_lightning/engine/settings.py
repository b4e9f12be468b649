"""The ``FederatedModule``'s settings checked up front: one ``ConfigError`` line naming key, value and fix."""

from __future__ import annotations

from torch import nn

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.client import Params, select
from fl_lightning.engine.contract import check_vectorizable
from fl_lightning.errors import ConfigError

__all__ = ["FP16_REFUSED", "check_algorithm_fits", "check_settings"]

FP16_REFUSED = (
    "trainer.precision 16-mixed is not supported: clients train inside one training_step without loss scaling "
    "and Lightning's scaler would unscale a server update that was never scaled; use bf16-mixed or 32"
)


def check_settings(
    lr: float,
    batch_size: int,
    eval_every: int | None,
    server_lr: float,
    client_dropout: float,
    stragglers: float,
    straggler_budget: float,
    eval_last: int,
    momentum: float,
    weight_decay: float,
    eval_clients: int | None = None,
) -> None:
    """The ranges of ``FederatedModule``'s numeric arguments (``model.*``)."""
    positive = {"lr": lr, "batch_size": batch_size, "eval_every": 1 if eval_every is None else eval_every}
    for name, value in {**positive, "server_lr": server_lr}.items():
        if value <= 0:
            raise ConfigError(f"model.{name} must be positive, got {value}")
    for name, value in {"client_dropout": client_dropout, "stragglers": stragglers}.items():
        if not 0 <= value <= 1:
            raise ConfigError(f"model.{name} is a probability in [0, 1], got {value}")
    if not 0 < straggler_budget <= 1:
        raise ConfigError(f"model.straggler_budget is a fraction in (0, 1], got {straggler_budget}")
    if eval_clients is not None and eval_clients < 1:
        raise ConfigError(f"model.eval_clients must be ≥ 1 (or null: every client), got {eval_clients}")
    for name, value in {"eval_last": eval_last, "momentum": momentum, "weight_decay": weight_decay}.items():
        if value < 0:
            raise ConfigError(f"model.{name} must be ≥ 0, got {value}")


def check_algorithm_fits(algorithm: Algorithm, net: nn.Module, glob: Params, aggregation: str) -> None:
    """Every personal prefix of ``algorithm`` names a parameter of ``net``; a method whose server keeps the exact
    mean of the clients' models gets ``model.aggregation: uniform``; a method that declares ``vectorizable`` uses
    only what the stacked path offers (``contract.check_vectorizable``)."""
    check_vectorizable(type(algorithm))
    for prefix in algorithm.personal:
        if not select(list(glob), [prefix]):
            names = [n for n, _ in net.named_parameters()]
            shown = ", ".join(names[:8]) + (f", … ({len(names)} in all)" if len(names) > 8 else "")
            raise ConfigError(
                f"personal prefix '{prefix}' of {type(algorithm).__name__} matches no parameter of "
                f"{type(net).__name__} (parameters: {shown})"
            )
    if algorithm.needs_uniform_aggregation and aggregation != "uniform":
        raise ConfigError(
            f"{type(algorithm).__name__} needs model.aggregation: uniform (its server keeps the exact mean "
            f"of the clients' models), got {aggregation}"
        )
