"""The documented defaults of the engine's entry points, which every config that leaves a setting out gets:
``FederatedModule``'s (spec 000 §3.2: client SGD with lr 0.01, momentum 0.5, batch 10; samples-weighted
aggregation; ``auto``, the executor ``executor.choose_path`` picks; the mean of the last 10 evaluations; no kept
client optimiser state; plain server SGD), plus ``steps_per_epoch``'s ``min_batch`` and a ledger's description
without a declaration."""

from __future__ import annotations

import pytest

from fl_lightning.algorithms import FedAvg
from fl_lightning.client import ClientOptimizer, steps_per_epoch
from fl_lightning.engine.ledger import CommunicationLedger
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP


def test_federated_module_defaults() -> None:
    """The defaults as the module keeps them (client optimiser, aggregation, executor, server SGD, …)."""
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    assert module.client_optimizer == ClientOptimizer(0.01, 0.5, 0.0, 10, True, None)
    assert (module.aggregation, module.executor, module.eval_last) == ("num_samples", "auto", 10)
    assert module.keep_client_optimizer_state is False
    rounds = module.round_optimizers
    assert (rounds.server_lr, rounds.server_momentum) == (1.0, 0.0)


@pytest.mark.parametrize("name", ["lr", "batch_size", "server_lr", "eval_every"])
def test_federated_module_refuses_a_non_positive_setting(name: str) -> None:
    """``lr``, ``batch_size``, ``eval_every`` and ``server_lr`` must be positive; the error names the setting."""
    with pytest.raises(ConfigError, match=f"model.{name} must be positive"):
        FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **{name: 0})


def test_steps_per_epoch_default_steps_on_a_last_single_sample_batch() -> None:
    """9 samples in batches of 4: 4, 4, 1 — three steps by default, two when ``min_batch`` is 2."""
    assert steps_per_epoch(9, 4) == 3
    assert steps_per_epoch(9, 4, 2) == 2
    assert steps_per_epoch(8, 4) == 2


def test_ledger_without_a_declaration_describes_nothing_beyond_the_upload() -> None:
    """A ledger built without ``reveals`` (and without side information) says the uploads reveal nothing beyond
    the declared upload."""
    ledger = CommunicationLedger(("head.",), (), set(), ["body.w"])
    assert ledger.describe() == "nothing beyond the declared upload"
