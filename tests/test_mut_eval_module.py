"""``FederatedModule``'s evaluation bookkeeping and simulated faults, called directly.

* ``simulate_faults``: a client fails (straggles) when its coin, the first ``torch.rand`` of a generator seeded
  with the low 63 bits of the BLAKE2b digest of ``repr((seed, "dropout" | "straggler", round, client))``, is
  strictly below the probability (the derivation is written out here with ``hashlib``);
* ``_finish_evaluation``: the per-client scores of the evaluation just run, for round ``rounds_trained − 1``,
  as ordinary tensors (not inference tensors) even when called inside Lightning's inference mode;
* ``_end_evaluations``: held-out new clients (accuracy, or MSE for regression) and "+FT", wired to
  ``evaluate_new_clients`` / ``evaluate_clients`` (stubbed here with known scores) with the round and split.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.executor import simulate_faults
from fl_lightning.engine.module import FederatedModule
from fl_lightning.metrics import PerClientScores
from fl_lightning.models import DigitsMLP

SEED, ROUND = 9, 5
COHORT = [3 * i + 2 for i in range(60)]


def _coin(tag: str, client: int) -> float:
    digest = hashlib.blake2b(repr((SEED, tag, ROUND, client)).encode(), digest_size=8).digest()
    seed = int.from_bytes(digest, "little") % 2**63
    return float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))


def _module(**kwargs: object) -> FederatedModule:
    module = FederatedModule(FedAvg(1, personal=("head.",)), DigitsMLP(hidden=(4,)), **kwargs)
    module.fed = SimpleNamespace(seed=SEED, num_classes=10)
    return module


# ---- simulate_faults ---------------------------------------------------------------------------------------------
def test_dropout_and_stragglers_follow_the_clients_seeded_coins() -> None:
    """p = 0.5 for both: the failed and the slow positions among ``mine`` (every other position) are those whose
    own coin is below 0.5; the two coins of a client are different draws."""
    mine = list(range(0, 60, 2))
    failed, slow = simulate_faults(_module(client_dropout=0.5, stragglers=0.5), ROUND, COHORT, mine)
    expected_failed = {j for j in mine if _coin("dropout", COHORT[j]) < 0.5}
    expected_slow = {j for j in mine if _coin("straggler", COHORT[j]) < 0.5}
    assert 0 < len(expected_failed) < len(mine) and 0 < len(expected_slow) < len(mine)
    assert expected_failed != expected_slow
    assert failed == expected_failed
    assert slow == expected_slow


def test_no_stragglers_without_a_straggler_probability() -> None:
    failed, slow = simulate_faults(_module(client_dropout=0.3), ROUND, COHORT, list(range(60)))
    assert failed == {j for j in range(60) if _coin("dropout", COHORT[j]) < 0.3}
    assert slow == set()


def test_a_coin_equal_to_the_probability_does_not_fault() -> None:
    """The probability set to a client's coin exactly: that client neither fails nor straggles (strictly below),
    while every client whose coin is lower does."""
    mine = list(range(60))
    p_drop, p_slow = _coin("dropout", COHORT[0]), _coin("straggler", COHORT[1])
    failed, slow = simulate_faults(_module(client_dropout=p_drop, stragglers=p_slow), ROUND, COHORT, mine)
    assert 0 not in failed and 1 not in slow
    assert failed == {j for j in mine if _coin("dropout", COHORT[j]) < p_drop}
    assert slow == {j for j in mine if _coin("straggler", COHORT[j]) < p_slow}


# ---- _finish_evaluation --------------------------------------------------------------------------------------------
def _scored_module() -> FederatedModule:
    module = _module()
    module.client_scores = PerClientScores(3)
    module.client_scores.update(0, 3.0, 4, 2.0)
    module.client_scores.update(2, 1.0, 2, 1.0)
    module.rounds_trained = 4
    return module


@pytest.mark.parametrize("inside_inference_mode", [False, True])
def test_finish_evaluation_is_the_last_trained_rounds_scores_as_ordinary_tensors(inside_inference_mode: bool) -> None:
    module = _scored_module()
    if inside_inference_mode:
        with torch.inference_mode():
            result = module._finish_evaluation()
    else:
        result = module._finish_evaluation()
    assert result is module.last_evaluation
    assert result.round == 3
    assert_close_finite(result.acc_per_client, torch.tensor([0.75, 0.0, 0.5], dtype=torch.float64))
    assert_close_finite(result.acc_mean, (0.75 + 0.5) / 2)
    assert not result.acc_per_client.is_inference() and not result.loss_per_client.is_inference()
    result.acc_per_client.add_(0.0)  # an inference tensor refuses in-place updates outside inference mode


# ---- _end_evaluations ----------------------------------------------------------------------------------------------
def _new_clients() -> FederatedData:
    split = ClientSplit(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long), torch.tensor([0, 1, 2]))
    return FederatedData(split, split, 10)


class _Calls:
    def __init__(self) -> None:
        self.new: list[tuple[int, FederatedData]] = []
        self.clients: list[tuple[int, FineTune | None, str]] = []

    def evaluate_new_clients(self, round_idx: int, new: FederatedData) -> dict[str, Tensor]:
        self.new.append((round_idx, new))
        return {"acc_mean": torch.tensor(0.625), "loss_mean": torch.tensor(1.75)}

    def evaluate_clients(self, round_idx: int, finetune: FineTune | None = None, split: str = "test") -> dict:
        self.clients.append((round_idx, finetune, split))
        return {
            "acc_per_client": torch.tensor([0.5, 1.0]),
            "loss_per_client": torch.tensor([0.25, 0.75]),
            "acc_mean": torch.tensor(0.75),
            "acc_weighted": torch.tensor(0.8),
            "loss_mean": torch.tensor(0.5),
            "samples_per_client": torch.tensor([2.0, 3.0]),
        }


def _wired(num_classes: int | None, finetune: FineTune | None) -> tuple[FederatedModule, _Calls, FederatedData]:
    module, calls, new = _module(finetune=finetune), _Calls(), _new_clients()
    module.fed = SimpleNamespace(seed=SEED, num_classes=num_classes)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(new_clients=new))
    module.evaluate_new_clients = calls.evaluate_new_clients
    module.evaluate_clients = calls.evaluate_clients
    return module, calls, new


def test_end_evaluations_reports_the_new_clients_accuracy() -> None:
    module, calls, new = _wired(10, None)
    out = module._end_evaluations(ROUND, split="test")
    assert out == {"final/new_clients_acc": 0.625}
    assert len(calls.new) == 1 and calls.new[0][0] == ROUND and calls.new[0][1] is new
    assert calls.clients == [] and module.finetuned_clients is None


def test_end_evaluations_reports_the_new_clients_mse_for_regression() -> None:
    module, calls, _ = _wired(None, None)
    assert module._end_evaluations(ROUND, split="test") == {"final/new_clients_mse": 1.75}


def test_end_evaluations_finetune_on_the_given_split_and_round() -> None:
    ft = FineTune(epochs=2, prefixes=("head.",))
    module, calls, _ = _wired(10, ft)
    out = module._end_evaluations(ROUND, split="val")
    assert out == {"final/new_clients_acc": 0.625, "final/acc_ft": 0.75}
    assert calls.clients == [(ROUND, ft, "val")]
    result = module.finetuned_clients
    assert result is not None and result.round == ROUND
    assert result.acc_per_client.tolist() == [0.5, 1.0]
    assert result.samples_per_client is not None and result.samples_per_client.tolist() == [2.0, 3.0]


def test_end_evaluations_without_new_clients_or_finetune_is_empty() -> None:
    """No datamodule with new clients (a trainer without a datamodule attribute, or no trainer) and no "+FT"."""
    module = _module()
    assert module._trainer is None
    assert module._end_evaluations(ROUND, split="test") == {}
    module._trainer = SimpleNamespace()
    assert module._end_evaluations(ROUND, split="test") == {}
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace())
    assert module._end_evaluations(ROUND, split="test") == {}
