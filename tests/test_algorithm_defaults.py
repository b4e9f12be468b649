"""Defaults a config that leaves them out relies on: one local epoch per round for the plain local-SGD methods
(FedAvg, FedPer, LG-FedAvg, Local), with the personal split each method is defined by."""

from __future__ import annotations

import pytest

from fl_lightning.algorithms import FedAvg, FedPer, LGFedAvg, LocalOnly


@pytest.mark.parametrize("cls", [FedAvg, FedPer, LGFedAvg, LocalOnly])
def test_one_local_epoch_by_default(cls):
    assert cls().local_epochs == 1


def test_default_personal_prefixes():
    assert tuple(FedPer().personal) == ("head.",)  # FedPer: personal head, shared body
    assert tuple(LGFedAvg().personal) == ("body.",)  # LG-FedAvg: personal lower layers, shared head
    assert tuple(FedAvg().personal) == ()
