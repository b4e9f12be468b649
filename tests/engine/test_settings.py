"""``fl_lightning/engine/settings.py``: ``FederatedModule``'s settings checked up front (ranges of the numeric
arguments, personal prefixes that match no parameter), each a one-line ``ConfigError``."""

from __future__ import annotations

import pytest

from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.small_modules import (
    make_module,
)
from tests.helpers.training import fit


def test_personal_prefix_that_matches_nothing_is_an_error():
    from fl_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="matches no parameter"):
        fit(FederatedModule(FedRep(1, 1, personal=("classifier.",)), DigitsMLP()), digits(), rounds=1)


@pytest.mark.parametrize("name", ["lr", "batch_size", "server_lr", "eval_every"])
def test_federated_module_refuses_a_non_positive_setting(name: str) -> None:
    """``lr``, ``batch_size``, ``eval_every`` and ``server_lr`` must be positive; the error names the setting."""
    with pytest.raises(ConfigError, match=f"model.{name} must be positive"):
        FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **{name: 0})


# ---- FederatedModule.__init__: argument checks ------------------------------------------------------------
@pytest.mark.parametrize("name", ["client_dropout", "stragglers"])
def test_probabilities_accept_0_and_1_and_refuse_above_1(name: str) -> None:
    assert getattr(make_module(**{name: 1.0}), name) == 1.0
    assert getattr(make_module(**{name: 0.0}), name) == 0.0
    with pytest.raises(ConfigError, match=f"model.{name} is a probability"):
        make_module(**{name: 1.5})
    with pytest.raises(ConfigError, match=f"model.{name} is a probability"):
        make_module(**{name: -0.1})


def test_straggler_budget_is_a_fraction_in_0_excluded_to_1() -> None:
    assert make_module(straggler_budget=1.0).straggler_budget == 1.0
    assert make_module(straggler_budget=0.25).straggler_budget == 0.25
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ConfigError, match="straggler_budget"):
            make_module(straggler_budget=bad)


@pytest.mark.parametrize("name", ["eval_last", "momentum", "weight_decay"])
def test_each_non_negative_setting_alone_is_refused_below_0(name: str) -> None:
    with pytest.raises(ConfigError, match="must be ≥ 0"):
        make_module(**{name: -1})


def test_eval_last_0_momentum_0_and_weight_decay_0_are_accepted() -> None:
    module = make_module(eval_last=0, momentum=0.0, weight_decay=0.0)
    assert module.eval_last == 0
    assert (module.client_optimizer.momentum, module.client_optimizer.weight_decay) == (0.0, 0.0)
