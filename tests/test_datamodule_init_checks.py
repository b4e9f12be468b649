"""``FederatedDataModule``'s constructor: the documented ranges of ``val_fraction``, ``participation`` and
``clients_per_round`` (their edges accepted, values past them refused), the cohort size derived from
``participation`` (default 0.1, at least one client), the seed ``make_federated`` records, and ``setup``'s
validation split stratified by class (the module passes its ``num_classes``)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError


def test_defaults_are_twenty_clients_and_a_tenth_of_them_per_round() -> None:
    dm = FederatedDataModule()
    assert dm.num_clients == 20
    assert dm.clients_per_round == 2  # round(0.1 · 20)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1])
def test_val_fraction_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="val_fraction"):
        FederatedDataModule(num_clients=4, val_fraction=bad)


@pytest.mark.parametrize("bad", [0.0, 1.5, 2.0])
def test_participation_outside_open_closed_unit_interval_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="participation"):
        FederatedDataModule(num_clients=4, participation=bad)


def test_participation_one_and_clients_per_round_edges_are_accepted() -> None:
    assert FederatedDataModule(num_clients=4, participation=1.0).clients_per_round == 4
    assert FederatedDataModule(num_clients=4, clients_per_round=1).clients_per_round == 1
    assert FederatedDataModule(num_clients=4, clients_per_round=4).clients_per_round == 4
    with pytest.raises(ConfigError, match="clients_per_round"):
        FederatedDataModule(num_clients=4, clients_per_round=0)
    with pytest.raises(ConfigError, match="clients_per_round"):
        FederatedDataModule(num_clients=4, clients_per_round=5)


@pytest.mark.parametrize(
    ("num_clients", "participation", "expected"),
    [(10, 0.5, 5), (30, None, 3), (5, 0.1, 1), (40, 0.25, 10), (7, None, 1)],
)
def test_cohort_size_is_participation_times_clients_at_least_one(
    num_clients: int, participation: float | None, expected: int
) -> None:
    r = 0.1 if participation is None else participation
    assert expected == max(1, round(r * num_clients))  # the reference rule, stated here
    assert FederatedDataModule(num_clients=num_clients, participation=participation).clients_per_round == expected


def test_make_federated_records_the_modules_seed() -> None:
    dm = FederatedDataModule(num_clients=2, seed=1234)
    x, y = torch.arange(8.0).view(4, 2), torch.tensor([0, 1, 0, 1])
    sets = [torch.tensor([0, 1]), torch.tensor([2, 3])]
    fed = dm.make_federated(x, y, sets, x, y, sets, 2)
    assert fed.seed == 1234


class _TwoClassClients(FederatedDataModule):
    """Every client holds 5 rows of class 0 and 5 of class 1."""

    def build(self) -> FederatedData:
        n = self.num_clients * 10
        y = torch.tensor([0, 1] * (n // 2))
        x = torch.arange(n, dtype=torch.float32).view(n, 1)
        sets = [torch.arange(10 * c, 10 * c + 10) for c in range(self.num_clients)]
        return self.make_federated(x, y, sets, x, y, sets, 2)


def test_setup_carves_a_stratified_validation_split() -> None:
    """fraction 0.2 of 10 rows = 2 val rows, one per class (proportional shares 1 and 1) on every client."""
    dm = _TwoClassClients(num_clients=20, seed=3, val_fraction=0.2)
    dm.setup("fit")
    val = dm.federated.val
    assert val is not None and val.num_clients == 20
    for c in range(20):
        _, yv = val.client(c)
        assert Counter(yv.tolist()) == {0: 1, 1: 1}, c
