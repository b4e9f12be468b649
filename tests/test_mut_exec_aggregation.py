"""``collect``, ``CohortSums.all_reduce`` on one process, ``CohortSums.mean_update`` and ``RoundStats.to_tensor``
called directly, against sums counted by hand: the weighted deltas and the round's counts with a non-finite client,
integer buffers, an empty rank, uploads outside the model, the device of everything collect builds (``meta`` stands
in for an accelerator), and the one-process reduction with a strategy that only reduces."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.engine.aggregation import CohortSums, RoundStats, collect
from fl_lightning.engine.ledger import CommunicationLedger

BIG = 16777217  # 2**24 + 1: exact in float64, not in float32


def ledger_for(template: dict[str, Tensor]) -> CommunicationLedger:
    return CommunicationLedger((), (), (), list(template))


def run_collect(
    updates: list[ClientUpdate],
    active: list[int],
    glob: dict[str, Tensor],
    template: dict[str, Tensor],
    states: dict[str, Tensor],
    weighting: str = "num_samples",
    stats: RoundStats | None = None,
    ledger: CommunicationLedger | None = None,
    round_idx: int = 4,
) -> CohortSums:
    cohort = [10, 11, 12, 13]
    ledger = ledger_for(template) if ledger is None else ledger
    stats = RoundStats() if stats is None else stats
    return collect(
        round_idx, cohort, list(range(4)), active, updates, glob, template, states, ledger, weighting, stats, "Algo"
    )


def three_clients(state_dtype: torch.dtype = torch.float32) -> list[ClientUpdate]:
    """Positions 0, 2, 3 report; position 2 (the second update) sent a NaN."""

    def up(w: list[float], v: list[float], n: int, loss: float) -> ClientUpdate:
        return ClientUpdate({"w": torch.tensor(w)}, {"v": torch.tensor(v, dtype=state_dtype)}, n, loss)

    return [
        up([2.0, 4.0], [1.0, 1.0], 3, 0.5),
        up([float("nan"), 0.0], [9.0, 9.0], 5, 0.25),
        up([0.0, 1.0], [2.0, 2.0], 2, 1.5),
    ]


GLOB = {"w": torch.tensor([1.0, 2.0])}
TEMPLATE = {"w": torch.zeros(2)}
STATES = {"v": torch.arange(8, dtype=torch.float32).view(4, 2)}


def test_num_samples_weighting_adds_only_the_finite_clients() -> None:
    sums = run_collect(three_clients(), [0, 2, 3], GLOB, TEMPLATE, STATES)
    # weights 3, (dropped), 2: Σ w (θ_k − θ) = 3·[1, 2] + 2·[−1, −1]
    assert sums.delta_sums["w"].dtype == torch.float64
    assert_close_finite(sums.delta_sums["w"], [1.0, 4.0], rtol=0, atol=0)
    assert sums.finite.tolist() == [True, False, True]
    # [weight, Σ w·loss, samples, survivors, non-finite]
    assert_close_finite(sums.counts, [5.0, 3 * 0.5 + 2 * 1.5, 5.0, 2.0, 1.0], rtol=0, atol=0)
    assert sums.positions == [0, 2, 3]
    # the NaN client keeps its old row (position 2 of the cohort's states)
    assert_close_finite(sums.state_rows["v"], [[1.0, 1.0], [4.0, 5.0], [2.0, 2.0]], rtol=0, atol=0)
    assert sums.notes == {"round": 4, "clients": [10, 12, 13]}


def test_uniform_weighting_gives_every_finite_client_weight_one() -> None:
    sums = run_collect(three_clients(), [0, 2, 3], GLOB, TEMPLATE, STATES, weighting="uniform")
    assert_close_finite(sums.delta_sums["w"], [0.0, 1.0], rtol=0, atol=0)
    assert_close_finite(sums.counts, [2.0, 0.5 + 1.5, 5.0, 2.0, 1.0], rtol=0, atol=0)


def test_new_state_rows_take_the_banks_dtype() -> None:
    sums = run_collect(three_clients(torch.float64), [0, 2, 3], GLOB, TEMPLATE, STATES)
    assert sums.state_rows["v"].dtype == torch.float32
    assert_close_finite(sums.state_rows["v"], [[1.0, 1.0], [4.0, 5.0], [2.0, 2.0]], rtol=0, atol=0)


def test_upload_bytes_are_added_to_the_round_statistics_and_the_ledger_sees_the_round() -> None:
    ledger = ledger_for(TEMPLATE)
    stats = RoundStats(upload_bytes=100.0, dropped=1.0)
    sums = run_collect(three_clients(), [0, 2, 3], GLOB, TEMPLATE, STATES, stats=stats, ledger=ledger, round_idx=7)
    assert sums.stats.upload_bytes == 100.0 + 3 * 2 * 4  # three uploads of two float32
    assert sums.stats.dropped == 1.0
    assert [(r.round, r.uploads) for r in ledger.history] == [(7, 3)]


def test_sample_counts_are_kept_exactly() -> None:
    ups = [ClientUpdate({"w": torch.tensor([1.0, 2.0])}, {"v": torch.zeros(2)}, n, 0.0) for n in (BIG, 3)]
    sums = run_collect(ups, [1, 3], GLOB, TEMPLATE, STATES)
    assert sums.counts.dtype == torch.float64
    assert sums.counts[0].item() == BIG + 3 and sums.counts[2].item() == BIG + 3


def test_integer_buffers_are_summed_in_float64() -> None:
    template, glob = {"n": torch.zeros((), dtype=torch.long)}, {"n": torch.tensor(0)}
    ups = [ClientUpdate({"n": torch.tensor(BIG)}, {}, 1, 0.0) for _ in range(2)]
    sums = run_collect(ups, [0, 1], glob, template, {}, weighting="uniform")
    assert sums.delta_sums["n"].dtype == torch.float64
    assert sums.delta_sums["n"].item() == 2 * BIG


def test_a_rank_without_reports_sums_float64_zeros_and_no_rows() -> None:
    template = {"w": torch.zeros(2), "n": torch.zeros((), dtype=torch.long)}
    sums = run_collect([], [], GLOB, template, STATES)
    assert {n: v.dtype for n, v in sums.delta_sums.items()} == {"w": torch.float64, "n": torch.float64}
    assert sums.delta_sums["w"].tolist() == [0.0, 0.0] and sums.delta_sums["n"].item() == 0.0
    assert sums.positions == []
    assert set(sums.state_rows) == {"v"} and sums.state_rows["v"].shape == (0, 2)


def test_uploads_outside_the_model_work_without_global_parameters() -> None:
    template = {"c": torch.zeros(2)}
    ups = [ClientUpdate({"c": torch.tensor([1.0, -1.0])}, {}, 2, 0.5), ClientUpdate({"c": torch.ones(2)}, {}, 1, 1.0)]
    sums = run_collect(ups, [0, 1], {}, template, {})
    assert_close_finite(sums.delta_sums["c"], [3.0, -1.0], rtol=0, atol=0)  # Σ w·upload (no global to subtract)
    assert sums.finite.device.type == "cpu"
    assert_close_finite(sums.counts, [3.0, 2.0, 3.0, 2.0, 0.0], rtol=0, atol=0)


def test_everything_collect_builds_is_on_the_models_device() -> None:
    meta = torch.device("meta")
    glob, template = {"w": torch.zeros(2, device=meta)}, {"w": torch.zeros(2, device=meta)}
    states = {"v": torch.zeros(4, 2, device=meta)}
    ups = [ClientUpdate({"w": torch.ones(2, device=meta)}, {"v": torch.ones(2, device=meta)}, 2, 0.5)] * 2
    sums = run_collect(ups, [0, 1], glob, template, states)
    assert sums.finite.device == meta and sums.counts.device == meta
    assert sums.delta_sums["w"].device == meta and sums.state_rows["v"].device == meta


# ---- all_reduce on one process -------------------------------------------------------------------------------
class OnlyReduce:
    """A one-process strategy that only reduces (no ``world_size``, no ``all_gather``): the identity."""

    def reduce(self, tensor: Tensor, reduce_op: Any = "mean") -> Tensor:
        return tensor


def test_one_process_returns_its_own_rows_with_or_without_a_layout() -> None:
    sums = run_collect(three_clients(), [0, 2, 3], GLOB, TEMPLATE, STATES)
    for layout in ([[0, 2, 3]], None):
        got = sums.all_reduce(OnlyReduce(), torch.device("cpu"), layout)
        assert got.positions == [0, 2, 3]
        assert_close_finite(got.state_rows["v"], [[1.0, 1.0], [4.0, 5.0], [2.0, 2.0]], rtol=0, atol=0)
        assert_close_finite(got.delta_sums["w"], [1.0, 4.0], rtol=0, atol=0)
        assert (got.stats.weight, got.stats.survivors, got.stats.non_finite) == (5.0, 2.0, 1.0)


def test_a_non_finite_client_is_logged_by_id(caplog: pytest.LogCaptureFixture) -> None:
    sums = run_collect(three_clients(), [0, 2, 3], GLOB, TEMPLATE, STATES)
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        sums.all_reduce(OnlyReduce(), torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == ["round 4: client 12 sent a non-finite update; it is dropped"]


def test_non_finite_clients_of_other_ranks_need_no_finite_mask_here() -> None:
    """A rank without reports (``finite`` None) sees another rank's non-finite count: nothing to log, no error."""
    sums = CohortSums({"w": torch.zeros(2, dtype=torch.float64)}, {}, [], RoundStats(non_finite=1.0))
    got = sums.all_reduce(OnlyReduce(), torch.device("cpu"), [[]])
    assert got.stats.non_finite == 1.0 and got.positions == []


# ---- mean_update and to_tensor --------------------------------------------------------------------------------
def test_the_mean_of_one_uniform_client_is_its_delta() -> None:
    sums = CohortSums({"w": torch.tensor([2.0, -4.0], dtype=torch.float64)}, {}, [], RoundStats(weight=1.0))
    mean = sums.mean_update({"w": torch.zeros(2)})
    assert mean["w"].dtype == torch.float32
    assert_close_finite(mean["w"], [2.0, -4.0], rtol=0, atol=0)


def test_no_weight_means_no_update() -> None:
    sums = CohortSums({"w": torch.ones(2, dtype=torch.float64)}, {}, [], RoundStats(weight=0.0))
    assert sums.mean_update({"w": torch.zeros(2)}) == {}


def test_integer_buffers_mean_stays_float64_and_unrounded() -> None:
    sums = CohortSums({"n": torch.tensor(5.5, dtype=torch.float64)}, {}, [], RoundStats(weight=2.0))
    mean = sums.mean_update({"n": torch.zeros((), dtype=torch.long)})
    assert mean["n"].dtype == torch.float64 and mean["n"].item() == 2.75


def test_the_weight_divides_in_float64() -> None:
    sums = CohortSums({"n": torch.tensor(float(BIG), dtype=torch.float64)}, {}, [], RoundStats(weight=float(BIG)))
    assert sums.mean_update({"n": torch.zeros((), dtype=torch.long)})["n"].item() == 1.0


def test_round_stats_travel_in_float64() -> None:
    values = RoundStats(weight=2.0, upload_bytes=float(BIG)).to_tensor("cpu")
    assert values.dtype == torch.float64
    assert values.tolist() == [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, float(BIG)]
