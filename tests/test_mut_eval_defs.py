"""``fl_lightning.engine.evaluation``'s small pieces, from numbers written out here: the client chunks of the validation
"dataloader", ``ClientEvaluation`` built from ``PerClientScores``' output and its spread, the logged metric names
(classification vs. regression, ``dist_B`` only with both a ground truth and a representation), the regression
score (squared error, no "correct" count) and when the shared-body fast path applies."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from helpers import assert_close_finite
from torch import nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine.evaluation import (
    ClientChunks,
    ClientEvaluation,
    FineTune,
    client_chunks,
    score_outputs,
    shared_body_applies,
    validation_metrics,
)
from fl_lightning.models.split import SplitModel

ACC = [0.5, 1.0, 0.25, 0.75]
LOSS = [1.0, 2.0, 4.0, 0.5]


# ---- client chunks ---------------------------------------------------------------------------------------------
def test_client_chunks_default_is_every_client_of_the_single_process_in_one_chunk() -> None:
    """Rank 0 of a world of 1 by default: 5 clients are one chunk of all five."""
    chunks = ClientChunks(5)
    assert len(chunks) == 1
    assert list(chunks) == [[0, 1, 2, 3, 4]]


def test_client_chunks_count_uses_this_ranks_share_of_the_clients() -> None:
    """300 clients on 2 ranks: 150 per rank fit one chunk of 256 (not 300 / 256 rounded up, not more)."""
    for rank in (0, 1):
        chunks = ClientChunks(300, rank, 2)
        assert len(chunks) == 1
        assert list(chunks) == [list(range(rank, 300, 2))]
    assert len(ClientChunks(600, 1, 2)) == 2  # 300 clients per rank: 256 + 44


def test_client_chunks_for_no_trainer_and_for_a_trainers_rank() -> None:
    """Without a trainer all clients are this process's; with one, its rank's share."""
    assert list(client_chunks(4)) == [[0, 1, 2, 3]]
    assert list(client_chunks(5, SimpleNamespace(global_rank=1, world_size=2))) == [[1, 3]]


# ---- ClientEvaluation ------------------------------------------------------------------------------------------
def _scores(with_samples: bool) -> dict[str, torch.Tensor]:
    scores = {
        "acc_per_client": torch.tensor(ACC, dtype=torch.float64),
        "loss_per_client": torch.tensor(LOSS, dtype=torch.float64),
        "acc_mean": torch.tensor(0.6, dtype=torch.float64),
        "acc_weighted": torch.tensor(0.55, dtype=torch.float64),
        "loss_mean": torch.tensor(1.5, dtype=torch.float64),
    }
    if with_samples:
        scores["samples_per_client"] = torch.tensor([2.0, 1.0, 4.0, 0.0], dtype=torch.float64)
    return scores


def test_from_scores_keeps_the_samples_per_client_when_given() -> None:
    result = ClientEvaluation.from_scores(_scores(True), 6)
    assert result.round == 6
    assert result.samples_per_client is not None
    assert result.samples_per_client.tolist() == [2.0, 1.0, 4.0, 0.0]
    assert [r["samples"] for r in result.rows()] == [2, 1, 4, 0]
    assert (result.acc_mean, result.acc_weighted, result.loss_mean) == (0.6, 0.55, 1.5)


def test_from_scores_without_samples_leaves_them_unknown() -> None:
    result = ClientEvaluation.from_scores(_scores(False), 2)
    assert result.samples_per_client is None
    assert [r["samples"] for r in result.rows()] == [-1, -1, -1, -1]


def test_spread_without_samples_counts_every_client() -> None:
    """Unknown samples: every client counts (the last client, with 0.75, too)."""
    result = ClientEvaluation.from_scores(_scores(False), 2)
    a, loss = np.array(ACC), np.array(LOSS)
    s = result.spread()
    assert_close_finite(s["acc_std"], a.std())
    assert_close_finite(s["acc_min"], a.min())
    assert_close_finite(s["acc_worst10"], a.min())  # ⌈0.1 · 4⌉ = 1 client
    r = result.spread(regression=True)
    assert_close_finite(r["mse_std"], loss.std())
    assert_close_finite(r["mse_max"], loss.max())
    assert_close_finite(r["mse_worst10"], loss.max())


# ---- validation_metrics ----------------------------------------------------------------------------------------
class _WithRepresentation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.representation = nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))


def test_validation_metrics_of_a_regression_run_are_the_mse_spread() -> None:
    """Regression (``num_classes`` None): mse_mean and the spread of the per-client errors over clients with
    data (the 4th has none), the highest error being the worst."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    fed = SimpleNamespace(num_classes=None, extras={})
    m = validation_metrics(result, fed, nn.Linear(1, 1), prefix="val")
    loss = np.array(LOSS[:3])
    assert sorted(m) == ["val/mse_max", "val/mse_mean", "val/mse_std", "val/mse_worst10"]
    assert_close_finite(m["val/mse_mean"], 1.5)
    assert_close_finite(m["val/mse_std"], loss.std())
    assert_close_finite(m["val/mse_max"], 4.0)


def test_validation_metrics_of_a_classification_run_are_the_accuracy_spread() -> None:
    """Classification: acc_mean, acc_weighted, loss and the accuracy spread (the lowest being the worst)."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    fed = SimpleNamespace(num_classes=3, extras={})
    m = validation_metrics(result, fed, nn.Linear(1, 1), prefix="test")
    a = np.array(ACC[:3])
    assert sorted(m) == [
        "test/acc_mean",
        "test/acc_min",
        "test/acc_std",
        "test/acc_weighted",
        "test/acc_worst10",
        "test/loss",
    ]
    assert_close_finite(m["test/acc_std"], a.std())
    assert_close_finite(m["test/acc_min"], 0.25)


def test_validation_metrics_dist_b_needs_both_the_ground_truth_and_a_representation() -> None:
    """A representation without ``B_star``, or ``B_star`` with a network that has no representation: no
    ``dist_B`` (and no error); both: the sine of the largest principal angle (here B* ⟂ the representation's
    second column partly)."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    b_star = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    without_truth = validation_metrics(result, SimpleNamespace(num_classes=3, extras={}), _WithRepresentation())
    assert "val/dist_B" not in without_truth
    no_rep = validation_metrics(result, SimpleNamespace(num_classes=3, extras={"B_star": b_star}), nn.Linear(1, 1))
    assert "val/dist_B" not in no_rep
    both = validation_metrics(result, SimpleNamespace(num_classes=3, extras={"B_star": b_star}), _WithRepresentation())
    assert_close_finite(both["val/dist_B"], 1.0)  # span{e1, e2} vs span{e1, e3}: a right angle


# ---- score_outputs ---------------------------------------------------------------------------------------------
def test_score_outputs_regression_is_the_summed_squared_error_and_no_correct_count() -> None:
    out = torch.tensor([[1.0], [2.0], [4.0]])
    y = torch.tensor([[0.5], [2.5], [1.0]], dtype=torch.float64)
    correct, n, sq = score_outputs(out, y, None)
    assert correct == 0.0
    assert n == 3
    assert_close_finite(sq, 0.25 + 0.25 + 9.0)


def test_score_outputs_classification_counts_the_arg_max_hits() -> None:
    out = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [0.5, 2.0, 1.0]])
    y = torch.tensor([0, 2, 0])
    correct, n, loss = score_outputs(out, y, 3)
    assert int(correct) == 2 and n == 3
    lse = np.log(np.exp(out.numpy().astype(np.float64)).sum(1))
    assert_close_finite(loss, (lse - np.array([2.0, 3.0, 0.5])).sum(), rtol=1e-6)


# ---- shared_body_applies ---------------------------------------------------------------------------------------
class _BodyHeadOnly(nn.Module):
    """A network with ``body`` and ``head`` and no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 2), nn.Linear(2, 2)


def _module(net: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(executor="vectorized", net=net, algorithm=FedAvg(1, personal=("head.",)))


def test_shared_body_applies_with_head_fine_tuning_and_not_with_body_fine_tuning() -> None:
    module = _module(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    assert shared_body_applies(module, None)
    assert shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("body.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("head.", "body.")))


def test_shared_body_applies_not_with_a_side_branch() -> None:
    module = _module(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2), side=nn.Identity()))
    assert not shared_body_applies(module, None)


def test_shared_body_applies_to_a_network_without_a_side_attribute() -> None:
    assert shared_body_applies(_module(_BodyHeadOnly()), None)


def test_shared_body_applies_only_to_the_vectorized_executor() -> None:
    module = _module(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    module.executor = "sequential"
    assert not shared_body_applies(module, None)
