"""Small ``FederatedModule``s and federations for the engine's unit tests: a FedAvg/FedRep module on a tiny
MLP, classification and regression clients of a few rows each, and a last evaluation with known per-client scores."""

from __future__ import annotations

from typing import Any

import torch

from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.evaluation import ClientEvaluation
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.clients import ranged_client_split as split


def make_module(**kwargs: Any) -> FederatedModule:
    return FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), **kwargs)


def digits_fed(extras: dict[str, torch.Tensor] | None = None) -> FederatedData:
    return FederatedData(split([3, 2], 64, True), split([2, 2], 64, True), 10, extras=extras or {})


def regression_fed(extras: dict[str, torch.Tensor] | None = None) -> FederatedData:
    return FederatedData(split([3, 2], 4, False), split([2, 2], 4, False), None, extras=extras or {})


def digits_fed_2(val: bool = False) -> FederatedData:
    return FederatedData(
        split([3, 2, 2, 2], 64, True),
        split([2, 2, 2, 2], 64, True),
        10,
        val=split([1, 1, 1, 1], 64, True) if val else None,
    )


def regression_fed_2() -> FederatedData:
    return FederatedData(split([3, 2, 2, 2], 4, False), split([2, 2, 2, 2], 4, False), None)


ACC = [0.5, 1.0, 0.25, 0.75]  # the last evaluation's per-client accuracies (4 clients, all with test data)


LOSS = [0.4, 0.1, 0.9, 0.3]


def last_evaluation(round_idx: int, acc: list[float] = ACC, loss: list[float] = LOSS) -> ClientEvaluation:
    return ClientEvaluation(
        round_idx,
        torch.tensor(acc, dtype=torch.float64),
        torch.tensor(loss, dtype=torch.float64),
        sum(acc) / len(acc),
        sum(acc) / len(acc),
        sum(loss) / len(loss),
        torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64),
    )


FEDAVG = "fl_lightning.algorithms.fedavg.FedAvg"


DIGITS = "fl_lightning.models.digits.DigitsMLP"


def split_2(rows: list[int]) -> ClientSplit:
    n = sum(rows)
    x = torch.arange(n * 64, dtype=torch.float32).reshape(n, 64) / 100.0
    ptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return ClientSplit(x, torch.arange(n) % 10, ptr)


def fed(clients: int) -> FederatedData:
    return FederatedData(split_2([2] * clients), split_2([1] * clients), 10)


def fedrep(clients: int, hidden: int = 4) -> FederatedModule:
    module = FederatedModule(FedRep(1, 1), DigitsMLP(hidden=(hidden,)))
    module.attach_data(fed(clients))
    return module
