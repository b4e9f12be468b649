"""``fl_lightning.metrics``: ``PerClientScores`` (per-client sums, exact counts, summed across ranks) and
``client_spread`` at its edges (no client with test data, a single client), from numbers written out here."""

from __future__ import annotations

import math

import torch
from helpers import assert_close_finite
from torch import Tensor

from fl_lightning.metrics import PerClientScores, client_spread

BIG = 2**24 + 1  # the first integer float32 cannot hold (float32 rounds it to 2**24)


# ---- client_spread -------------------------------------------------------------------------------------------
def test_client_spread_without_any_client_with_data_is_nan_under_the_three_names() -> None:
    """Every client has 0 test samples: nothing to spread over, so std, worst10 and worst are all NaN."""
    out = client_spread(torch.tensor([0.7, 0.2, 0.9]), torch.tensor([0, 0, 0]))
    assert sorted(out) == ["std", "worst", "worst10"]
    assert all(isinstance(v, float) and math.isnan(v) for v in out.values()), out
    empty = client_spread(torch.tensor([]), torch.tensor([]), higher_is_better=False)
    assert sorted(empty) == ["std", "worst", "worst10"]
    assert all(math.isnan(v) for v in empty.values()), empty


def test_client_spread_of_a_single_client_with_data_is_that_client() -> None:
    """One client with test data (the others have none): std 0, worst10 = worst = its value."""
    values, samples = torch.tensor([0.25, 0.6, 0.8]), torch.tensor([0, 4, 0])
    for higher in (True, False):
        out = client_spread(values, samples, higher_is_better=higher)
        assert_close_finite(out["std"], 0.0)
        assert_close_finite(out["worst10"], 0.6, rtol=1e-6)
        assert_close_finite(out["worst"], 0.6, rtol=1e-6)


# ---- PerClientScores -----------------------------------------------------------------------------------------
def test_per_client_scores_update_accumulates_over_calls() -> None:
    """Two updates of the same client add up (a client scored in two slices of 2048 samples)."""
    m = PerClientScores(2)
    m.update(0, 3.0, 4, 2.0)
    m.update(0, 1.0, 6, 3.0)
    m.update(1, 2.0, 5, 1.0)
    out = m.compute()
    assert_close_finite(out["samples_per_client"], torch.tensor([10.0, 5.0], dtype=torch.float64))
    assert_close_finite(out["acc_per_client"], torch.tensor([4 / 10, 2 / 5], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([5 / 10, 1 / 5], dtype=torch.float64))
    assert_close_finite(out["acc_weighted"], 6 / 15)


def test_per_client_scores_client_with_one_sample_is_divided_by_one() -> None:
    """A client with a single test sample: its accuracy and loss are its own (not halved); a client without
    samples reads 0 and is left out of the means; the weighted accuracy over one sample is that sample's."""
    m = PerClientScores(3)
    m.update(0, 1.0, 1, 0.75)
    m.update(2, 1.0, 4, 2.0)
    out = m.compute()
    assert_close_finite(out["acc_per_client"], torch.tensor([1.0, 0.0, 0.25], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([0.75, 0.0, 0.5], dtype=torch.float64))
    assert_close_finite(out["acc_mean"], (1.0 + 0.25) / 2)
    assert_close_finite(out["loss_mean"], (0.75 + 0.5) / 2)
    single = PerClientScores(1)
    single.update(0, 1.0, 1, 0.5)
    assert_close_finite(single.compute()["acc_weighted"], 1.0)


def test_per_client_scores_counts_are_exact_beyond_float32() -> None:
    """The sums are float64: 2**24 + 1 samples (and correct predictions, and summed loss) stay exact."""
    m = PerClientScores(2)
    m.update(0, float(BIG), BIG, float(BIG))
    m.update(1, 1.0, 2, 1.0)
    out = m.compute()
    assert float(out["samples_per_client"][0]) == float(BIG)
    assert out["samples_per_client"].dtype == torch.float64
    assert float(out["acc_per_client"][0]) == 1.0
    assert float(out["loss_per_client"][0]) == 1.0
    assert float(out["acc_weighted"]) == (BIG + 1) / (BIG + 2)


def _two_ranks(rank0: PerClientScores, rank1: PerClientScores) -> None:
    """Make ``rank0`` sync as if ``rank1`` were the other process: the gather returns both ranks' state."""
    other = {"correct": rank1.correct, "total": rank1.total, "loss_sum": rank1.loss_sum}

    def gather(t: Tensor, group: object = None) -> list[Tensor]:
        name = next(n for n in other if getattr(rank0, n) is t)
        return [t, other[name]]

    rank0.dist_sync_fn = gather
    rank0.distributed_available_fn = lambda: True


def test_per_client_scores_sum_every_rank_clients_on_compute() -> None:
    """Two ranks each score their own clients (0 and 2 on rank 0, 1 on rank 1): ``compute`` sees every
    client's sums, as if one process had scored them all."""
    r0, r1 = PerClientScores(3), PerClientScores(3)
    r0.update(0, 3.0, 4, 1.0)
    r0.update(2, 1.0, 2, 0.5)
    r1.update(1, 5.0, 5, 2.5)
    r1.update(2, 1.0, 2, 1.5)  # a client both ranks saw: the sums add up
    _two_ranks(r0, r1)
    out = r0.compute()
    assert out["acc_per_client"].shape == (3,)
    assert_close_finite(out["samples_per_client"], torch.tensor([4.0, 5.0, 4.0], dtype=torch.float64))
    assert_close_finite(out["acc_per_client"], torch.tensor([3 / 4, 5 / 5, 2 / 4], dtype=torch.float64))
    assert_close_finite(out["loss_per_client"], torch.tensor([1 / 4, 2.5 / 5, 2 / 4], dtype=torch.float64))
    assert_close_finite(out["acc_weighted"], 10 / 13)
