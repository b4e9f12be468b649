"""The run's optimisers as Lightning sees them: the server step and the clients' learning rate per round.

``configure_optimizers`` returns two optimisers, each with a learning-rate schedule stepped once per round:

* ``lr/server``: the server optimiser (SGD with ``server_lr``/``server_momentum``, or ``model.server_optimizer``:
  ``FedAdam``, ``FedYogi``, ``FedAdagrad``, any ``torch.optim`` class). The engine writes the pseudo-gradient
  into ``p.grad`` and steps it, so ``trainer.global_step`` counts rounds.
* ``lr/client``: the client optimiser class over one dummy parameter, which the engine never steps with a
  gradient. It only carries the clients' learning rate: ``model.client_lr_schedule`` moves it once per round,
  and every client of round t trains with the lr it holds at the start of round t.

Registering both with Lightning is what makes ``LearningRateMonitor`` log ``lr/server`` and ``lr/client``
(with ``log_momentum``, also the client optimiser's momentum or β₁), and checkpoints carry both schedules,
so a resumed run continues with the same learning rates. Without a configured schedule the learning rate is
constant (``ConstantLR`` with factor 1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import ConstantLR, LRScheduler, ReduceLROnPlateau

from fl_lightning.client import ClientOptimizer, OptimizerCallable, factory_name
from fl_lightning.errors import ConfigError

#: A ``torch.optim.lr_scheduler`` class with its init args: ``optimizer -> LRScheduler``
#: (``lightning.pytorch.cli.LRSchedulerCallable``, spelled out so that the engine does not import jsonargparse).
LRSchedulerCallable = Callable[[torch.optim.Optimizer], LRScheduler]

log = logging.getLogger("fl_lightning")

#: the FederatedModule arguments that are optimiser factories (not hyperparameters Lightning can save)
OPTIMIZER_ARGS = ("client_optimizer", "client_lr_schedule", "server_optimizer", "server_lr_schedule")
FLAT_CLIENT_DEFAULTS = {"lr": 0.01, "momentum": 0.5, "weight_decay": 0.0}


@dataclass
class RoundOptimizers:
    """Builds the two optimisers and their schedules (``client_lr`` holds the clients' learning rate), steps the
    schedules."""

    client: ClientOptimizer
    server_factory: OptimizerCallable | None = None
    server_lr: float = 1.0
    server_momentum: float = 0.0
    server_schedule: LRSchedulerCallable | None = None
    client_schedule: LRSchedulerCallable | None = None
    #: the client optimiser over one dummy parameter that carries the clients' learning rate (None until fitting)
    client_lr: Optimizer | None = field(default=None, repr=False)
    _schedulers: list[LRScheduler] = field(default_factory=list, repr=False)

    def check(self, flat_client: dict[str, float]) -> None:
        """Build everything once on dummy parameters, so a bad class or argument stops before training."""
        server = self.build_server([torch.zeros(1, requires_grad=True)])
        self._schedule(self.server_schedule, server, "model.server_lr_schedule")
        self._schedule(self.client_schedule, self._client_holder(), "model.client_lr_schedule")
        if self.server_factory is not None and (self.server_lr != 1.0 or self.server_momentum != 0.0):
            log.warning("model.server_lr and model.server_momentum are ignored: model.server_optimizer sets them")
        if self.client.factory is not None and any(flat_client[k] != v for k, v in FLAT_CLIENT_DEFAULTS.items()):
            log.warning("model.lr, model.momentum and model.weight_decay are ignored: model.client_optimizer sets them")

    def build_server(self, params: list[Tensor]) -> Optimizer:
        if self.server_factory is None:
            return torch.optim.SGD(params, lr=self.server_lr, momentum=self.server_momentum)
        try:
            return self.server_factory(params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"model.server_optimizer: {factory_name(self.server_factory)} cannot be used: {exc}"
            ) from None

    def _client_holder(self) -> Optimizer:
        """The client optimiser over one dummy parameter: it holds the clients' learning rate."""
        return self.client.build({"client_lr": torch.zeros(1, requires_grad=True)})

    @staticmethod
    def _schedule(factory: LRSchedulerCallable | None, optimizer: Optimizer, key: str) -> LRScheduler:
        if factory is None:
            return ConstantLR(optimizer, factor=1.0, total_iters=0)
        try:
            scheduler = factory(optimizer)
        except (TypeError, ValueError, KeyError) as exc:
            raise ConfigError(f"{key}: {factory_name(factory)} cannot be used: {exc}") from None
        if isinstance(scheduler, ReduceLROnPlateau):
            raise ConfigError(f"{key}: ReduceLROnPlateau needs a metric; use a schedule over rounds (StepLR, …)")
        return scheduler

    def configure(self, trainable: list[Tensor]) -> tuple[list[Optimizer], list[dict[str, Any]]]:
        """``configure_optimizers``' answer: [server, client lr] and their per-round schedules."""
        server, self.client_lr = self.build_server(trainable), self._client_holder()
        self._schedulers = [
            self._schedule(self.server_schedule, server, "model.server_lr_schedule"),
            self._schedule(self.client_schedule, self.client_lr, "model.client_lr_schedule"),
        ]
        configs = [
            {"scheduler": s, "name": name, "interval": "step"}
            for s, name in zip(self._schedulers, ("lr/server", "lr/client"))
        ]
        return [server, self.client_lr], configs

    def step_schedules(self) -> None:
        """End of a round: both learning rates move to the next round's values."""
        if self.client_lr is not None:
            self.client_lr.step()  # no gradient, so no change; torch wants a step before a scheduler step
        for scheduler in self._schedulers:
            scheduler.step()
