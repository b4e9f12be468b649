"""``fl_lightning/engine/aggregation.py``: uploads collected and summed (on one process and over two real ranks),
the weighted mean update, the server step, client assignment to ranks and the gathering of state rows; the
communication ledger's byte counts from parameter shapes, what it describes without a declaration, and its refusal
of a personal upload."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn

import fl_lightning
from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import L2GD, FedAvg, FedMTL, FedRep
from fl_lightning.algorithms.base import ClientUpdate, RoundFacts
from fl_lightning.engine.aggregation import (
    Aggregation,
    CohortSums,
    CommunicationLedger,
    ParamBackup,
    PrivacyViolation,
    RoundReports,
    RoundStats,
    add_delta,
    all_finite,
    check_finite,
    client_losses,
    gather_rows,
    rows_finite,
    server_step,
    tensor_bytes,
)
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.digits_runs import digits
from tests.helpers.functional_mlp import run_digits
from tests.helpers.split_models import ROUNDS, read_metrics
from tests.helpers.training import fit, make_trainer


@pytest.mark.parametrize("algorithm", [L2GD, FedMTL])
def test_methods_that_keep_an_exact_mean_refuse_weighted_aggregation(algorithm):
    with pytest.raises(ConfigError, match="needs model.aggregation: uniform"):
        run_digits(algorithm(), aggregation="num_samples")


def test_aggregation_weights_uniform_vs_num_samples():
    """One round of FedAvg: the new global model is the (weighted) mean of the clients' models."""
    from datamodules import Dirichlet

    for aggregation in ("uniform", "num_samples"):
        L.seed_everything(0, verbose=False)
        dm = DigitsDataModule(num_clients=6, partition=Dirichlet(0.5), clients_per_round=3, seed=0)
        module = FederatedModule(FedAvg(1), DigitsMLP(), aggregation=aggregation, eval_every=100)
        init = {n: p.detach().clone() for n, p in module.net.named_parameters()}
        uploads = []
        original_attach = module.attach_data

        def attach_and_observe(fed, module=module, original_attach=original_attach, uploads=uploads):
            original_attach(fed)
            module.ledger.observers.append(
                lambda r, cid, t: uploads.append((cid, {k: v.clone() for k, v in t.items()}))
            )

        module.attach_data = attach_and_observe
        make_trainer(1).fit(module, datamodule=dm)
        sizes = dm.federated.train.sizes
        w = torch.tensor([1.0 if aggregation == "uniform" else float(sizes[c]) for c, _ in uploads])
        for n, p in module.net.named_parameters():
            expected = init[n] + sum(wi * (u[n] - init[n]) for wi, (_, u) in zip(w, uploads)) / w.sum()
            assert_close_finite(p.detach(), expected, rtol=1e-5, atol=1e-6)


def test_batchnorm_buffers_are_averaged_including_the_integer_counter():
    from collections import OrderedDict

    from torch import nn

    from fl_lightning.models.split import SplitModel

    class BNNet(SplitModel):
        def __init__(self):
            body = OrderedDict(
                conv=nn.Conv2d(1, 4, 3, padding=1), bn=nn.BatchNorm2d(4), relu=nn.ReLU(), flat=nn.Flatten()
            )
            super().__init__(nn.Sequential(body), nn.Linear(256, 10))

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    module = FederatedModule(FedAvg(1), BNNet(), aggregation="uniform", eval_every=100)
    uploads = []
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: uploads.append({k: v.clone() for k, v in t.items()}))

    module.attach_data = attach_and_observe
    fit(module, dm, rounds=1)
    mean = torch.stack([u["body.bn.running_mean"] for u in uploads]).mean(0)
    assert_close_finite(module.net.body.bn.running_mean, mean)
    counts = [int(u["body.bn.num_batches_tracked"]) for u in uploads]
    assert module.net.body.bn.num_batches_tracked.dtype == torch.long
    assert int(module.net.body.bn.num_batches_tracked) == round(sum(counts) / len(counts))


class ThreadAllGather:
    """``all_gather`` for ``world`` threads: each rank's tensor, stacked in rank order ``[world, ...]``."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, {}, threading.Barrier(world, timeout=30)

    def for_rank(self, rank: int):
        outer = self

        class Rank:
            world_size = outer.world

            def all_gather(self, t):
                outer.slots.setdefault(id(t.dtype), [None] * outer.world)[rank] = t.clone()
                outer.barrier.wait()
                out = torch.stack(outer.slots[id(t.dtype)])
                outer.barrier.wait()
                return out

        return Rank()


def run_ranks(rows_by_rank, layout):
    world = len(rows_by_rank)
    gather, results = ThreadAllGather(world), [None] * world

    def work(r):
        try:
            results[r] = gather_rows(gather.for_rank(r), rows_by_rank[r], layout)
        except BaseException as e:  # reported by the test thread below
            results[r] = e
            gather.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_every_rank_gets_all_rows_in_rank_order_whatever_the_dtypes():
    layout = [[0, 2, 3], [1]]  # rank 0 holds cohort positions 0, 2, 3; rank 1 holds position 1
    g = torch.Generator().manual_seed(0)
    # three float32 tensors of different shapes travel in one all-gather; int64 and float64 in their own
    rank0 = {"head.w": torch.randn(3, 2, 4, generator=g), "head.b": torch.randn(3, 5, generator=g),
             "v.c": torch.randn(3, 3, generator=g),
             "steps": torch.tensor([5, 6, 7]), "v.b": torch.randn(3, 2, generator=g, dtype=torch.float64)}  # fmt: skip
    rank1 = {"head.w": torch.randn(1, 2, 4, generator=g), "head.b": torch.randn(1, 5, generator=g),
             "v.c": torch.randn(1, 3, generator=g),
             "steps": torch.tensor([9]), "v.b": torch.randn(1, 2, generator=g, dtype=torch.float64)}  # fmt: skip
    results = run_ranks([rank0, rank1], layout)
    for rows, positions in results:
        assert positions == [0, 2, 3, 1]
        assert set(rows) == {"head.w", "head.b", "v.c", "steps", "v.b"}
        for n in rows:
            expected = torch.cat([rank0[n], rank1[n]])
            assert rows[n].dtype == expected.dtype and rows[n].shape == expected.shape
            assert torch.equal(rows[n], expected), n


def test_no_rows_or_no_clients_gather_nothing():
    class NoCollective:
        def all_gather(self, t):
            raise AssertionError("nothing to gather")

    rows, positions = gather_rows(NoCollective(), {"head.w": torch.ones(2, 3)}, [[], []])
    assert positions == [] and rows["head.w"].shape == (0, 3)
    rows, positions = gather_rows(NoCollective(), {}, [[0], [1]])
    assert positions == [0, 1] and rows == {}


def test_a_rank_without_clients_this_round_still_takes_part():
    """A cohort smaller than the number of ranks leaves a rank with no rows; it sends padding and gets the others'."""
    layout = [[0], []]
    rank0 = {"head.w": torch.arange(6.0).view(1, 2, 3), "steps": torch.tensor([4])}
    rank1 = {"head.w": torch.zeros(0, 2, 3), "steps": torch.zeros(0, dtype=torch.long)}
    for rows, positions in run_ranks([rank0, rank1], layout):
        assert positions == [0]
        assert torch.equal(rows["head.w"], rank0["head.w"]) and torch.equal(rows["steps"], rank0["steps"])


ROOT = Path(__file__).resolve().parents[2]  # the repository (or mutants/) root: ``tests`` imports from it


LAYOUT = [[0, 2], [1]]  # rank 0 reports cohort positions 0 and 2, rank 1 position 1


# rank r's own sums: a float32 model delta, a float64 extra upload; rows of a float32 and an int64 state entry
DELTAS = {
    0: {"w": [1.5, -2.0, 0.25, 4.0], "c": [0.125, 3.0]},
    1: {"w": [0.5, 1.0, -0.75, 2.0], "c": [1.0, -1.0]},
}


ROWS = {0: {"v": [[1.0, 2.0], [3.0, 4.0]], "n": [7, 9]}, 1: {"v": [[5.0, 6.0]], "n": [8]}}


# [weight, weighted_loss, samples, survivors, non_finite] on the device, and the host-side statistics
COUNTS = {0: [2.0, 1.5, 30.0, 2.0, 0.0], 1: [1.0, 0.25, 12.0, 1.0, 0.0]}


HOST = {0: dict(dropped=1.0, stragglers=0.0, upload_bytes=16777217.0), 1: dict(dropped=0.0, stragglers=2.0)}


def rank_sums(rank: int) -> CohortSums:
    deltas = {
        "w": torch.tensor(DELTAS[rank]["w"], dtype=torch.float32).view(2, 2),
        "c": torch.tensor(DELTAS[rank]["c"], dtype=torch.float64),
    }
    rows = {"v": torch.tensor(ROWS[rank]["v"]), "n": torch.tensor(ROWS[rank]["n"], dtype=torch.long)}
    counts = torch.tensor(COUNTS[rank], dtype=torch.float64)
    finite = torch.ones(len(LAYOUT[rank]), dtype=torch.bool)
    return CohortSums(deltas, rows, list(LAYOUT[rank]), RoundStats(**HOST[rank]), counts, finite, {})


def strategy(rank: int) -> DDPStrategy:
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(rank)
    return DDPStrategy(cluster_environment=env, process_group_backend="gloo")


def join(rank: int, port: int, store: dist.TCPStore | None = None) -> None:
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))


def rank_one(port: int, out: str) -> None:
    """Rank 1 (in the subprocess): reduce, then save what it got."""
    join(1, port)
    try:
        got = rank_sums(1).all_reduce(strategy(1), torch.device("cpu"), LAYOUT)
        torch.save({"sums": got.delta_sums, "rows": got.state_rows, "positions": got.positions}, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory: pytest.TempPathFactory) -> tuple[CohortSums, dict]:
    out = tmp_path_factory.mktemp("allreduce") / "rank1.pt"
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=timedelta(seconds=60))
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # the same fl_lightning (and active mutant) as this process; mutmut's call statistics are this process's
        "PYTHONPATH": os.pathsep.join([str(Path(fl_lightning.__file__).parents[1]), str(ROOT)]),
        "MUTANT_UNDER_TEST": "" if mutant in ("stats", "fail") else mutant,
    }
    code = f"import {__name__} as t; t.rank_one({store.port}, {str(out)!r})"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        join(0, store.port, store)
        try:
            mine = rank_sums(0).all_reduce(strategy(0), torch.device("cpu"), LAYOUT)
        finally:
            dist.destroy_process_group()
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err[-3000:]
    return mine, torch.load(out, weights_only=False)


def test_the_sums_are_added_over_both_ranks_in_their_dtypes(reduced: tuple[CohortSums, dict]) -> None:
    mine, other = reduced
    for got in (mine.delta_sums, other["sums"]):
        assert got["w"].dtype == torch.float32 and got["c"].dtype == torch.float64
        assert got["w"].shape == (2, 2)
        assert_close_finite(got["w"], [[2.0, -1.0], [-0.5, 6.0]], rtol=0, atol=0)
        assert_close_finite(got["c"], [1.125, 2.0], rtol=0, atol=0)


def test_the_statistics_are_added_over_both_ranks(reduced: tuple[CohortSums, dict]) -> None:
    stats = reduced[0].stats
    assert isinstance(stats, RoundStats)
    assert (stats.weight, stats.weighted_loss, stats.samples, stats.survivors) == (3.0, 1.75, 42.0, 3.0)
    assert (stats.dropped, stats.non_finite, stats.stragglers) == (1.0, 0.0, 2.0)
    assert stats.upload_bytes == 16777217.0  # exact: the statistics travel in float64
    assert reduced[0].counts is None and reduced[0].finite is None


def test_every_rank_gets_every_state_row_in_layout_order(reduced: tuple[CohortSums, dict]) -> None:
    mine, other = reduced
    for rows, positions in ((mine.state_rows, mine.positions), (other["rows"], other["positions"])):
        assert positions == [0, 2, 1]
        assert set(rows) == {"v", "n"}
        assert rows["n"].dtype == torch.long and rows["n"].tolist() == [7, 9, 8]
        assert_close_finite(rows["v"], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], rtol=0, atol=0)


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
    reports = RoundReports(round_idx, cohort, active, updates, glob, template, states)
    return Aggregation(ledger, weighting, "Algo").collect(reports, stats)


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


def test_add_delta_keeps_a_float32_value_float32() -> None:
    out = add_delta(torch.tensor([1.0, 2.0]), torch.tensor([0.5, -0.25], dtype=torch.float64))
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 1.75]


def test_add_delta_rounds_into_an_integer_buffer() -> None:
    out = add_delta(torch.tensor([3, 10]), torch.tensor([1.6, -2.4], dtype=torch.float64))
    assert out.dtype == torch.long and out.tolist() == [5, 8]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[set[str], dict[str, Tensor], RoundFacts]] = []

    def server_update(self, state: dict[str, Tensor], extra: dict[str, Tensor], facts: RoundFacts) -> None:
        self.calls.append((set(state), dict(extra), facts))


def test_server_step_hands_only_the_extra_uploads_to_the_algorithm() -> None:
    """One parameter (stepped by SGD lr 1 on −Δ: ``w + Δ``), one buffer (``+ Δ``), one upload outside the model."""
    net = nn.Module()
    net.w = nn.Parameter(torch.tensor([1.0, 2.0]))
    net.register_buffer("b", torch.tensor([5.0]))
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    algo = _Recorder()
    upd = {"w": torch.tensor([0.5, -1.0]), "b": torch.tensor([2.0]), "c": torch.tensor([7.0])}
    server_step(net, opt, algo, upd, RoundFacts(3, num_aggregated=5))  # type: ignore[arg-type]
    assert net.w.detach().tolist() == [1.5, 1.0] and net.b.tolist() == [7.0]
    ((state, extra, facts),) = algo.calls
    assert state == {"w", "b"} and facts == RoundFacts(3, 5)
    assert set(extra) == {"c"} and extra["c"].tolist() == [7.0]


def test_collect_counts_sample_sizes_beyond_float32_exactly() -> None:
    """Two clients with 2**24 + 1 and 2 samples: weight and sample counts 2**24 + 3 (not a float32 number)."""
    big = 2**24 + 1
    template: dict[str, Any] = {"w": torch.zeros(1)}
    ups = [ClientUpdate({"w": torch.tensor([1.0])}, {}, n, 0.0) for n in (big, 2)]
    ledger = CommunicationLedger((), (), (), list(template))
    reports = RoundReports(0, [0, 1], [0, 1], ups, {"w": torch.zeros(1)}, template, {})
    sums = Aggregation(ledger, "num_samples", "Algo").collect(reports, RoundStats())
    assert sums.counts is not None
    assert sums.counts[0].item() == big + 2 and sums.counts[2].item() == big + 2


# ---- collect's buffers against the per-tensor sums, bit for bit ---------------------------------------------------
def reference_collect(
    updates: list[ClientUpdate], active: list[int], glob: dict[str, Tensor], template: dict[str, Tensor],
    states: dict[str, Tensor], uniform: bool = False,
) -> tuple[dict[str, Tensor], dict[str, Tensor], list[bool], list[float]]:
    """The weighted delta sums, new state rows, finite flags and counts of ``updates``, tensor by tensor and client by
    client in plain torch: a client with any non-finite float (upload or state) adds nothing and keeps its old rows;
    each upload's sum is Σ_k w_k (u_k − g) with the products in the upload's dtype, added in float64."""
    finite = [
        all(bool(torch.isfinite(t).all()) for t in (*u.upload.values(), *u.state.values()) if t.is_floating_point())
        for u in updates
    ]
    weights = [(1.0 if uniform else float(u.num_samples)) if ok else 0.0 for u, ok in zip(updates, finite)]
    sums = {}
    for n in template:
        rows = []
        for u, ok, w in zip(updates, finite, weights):
            delta = u.upload[n] - glob[n] if n in glob else u.upload[n]
            delta = delta if delta.is_floating_point() else delta.double()
            delta = delta if ok else torch.zeros_like(delta)
            rows.append((torch.tensor(w, dtype=torch.float64).to(delta.dtype) * delta).double())
        sums[n] = torch.stack(rows).sum(0)
    new_rows = {}
    for n, old in states.items():
        new_rows[n] = torch.stack([u.state[n].to(old.dtype) if ok else old[j]
                                   for j, u, ok in zip(active, updates, finite)])  # fmt: skip
    losses = [float(torch.as_tensor(u.loss).double()) for u in updates]
    counts = [sum(weights), sum(w * v for v, w, ok in zip(losses, weights, finite) if ok),
              float(sum(u.num_samples for u, ok in zip(updates, finite) if ok)), float(sum(finite)),
              float(len(finite) - sum(finite))]  # fmt: skip
    return sums, new_rows, finite, counts


SHAPES = {"a": (128, 64), "b": (), "c": (7, 5), "d": (1,), "e": (33,)}


@pytest.mark.parametrize("k", [1, 3, 4, 5, 7, 17])
@pytest.mark.parametrize("bad", [None, 0, "last"])
def test_collect_gives_the_per_tensor_sums_and_rows_bit_for_bit(k: int, bad: Any) -> None:
    """Uploads of several shapes (scalars too), one outside the model, an integer one, float32 and float64 state
    rows (one written into a float32 bank), a client with a NaN in an upload or a state row, K from 1 to 17."""
    g = torch.Generator().manual_seed(k)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:  # values over twelve orders of magnitude
        scale = 10.0 ** torch.randint(-6, 6, (), generator=g).item()
        return (torch.randn(shape, generator=g) * scale).to(dtype)

    glob = {n: rnd(*s) for n, s in SHAPES.items()}
    template = {**{n: torch.zeros(s) for n, s in SHAPES.items()}, "extra": torch.zeros(3),
                "count": torch.zeros((), dtype=torch.long)}  # fmt: skip
    glob["count"] = torch.tensor(5)
    cohort = list(range(10, 10 + k + 2))
    active = list(range(1, k + 1))  # position 0 and the last one did not report
    states = {"v.a": rnd(k + 2, 4, 3), "v.b": rnd(k + 2, 2, dtype=torch.float64), "v.c": rnd(k + 2, 5)}
    updates = []
    for i in range(k):
        upload = {n: glob[n] + rnd(*s) for n, s in SHAPES.items()}
        upload["extra"], upload["count"] = rnd(3), torch.tensor(5 + i)
        state = {"v.a": rnd(4, 3), "v.b": rnd(2, dtype=torch.float64), "v.c": rnd(5, dtype=torch.float64)}
        updates.append(ClientUpdate(upload, state, 10 + 3 * i, torch.tensor(0.5 + i, dtype=torch.float32)))
    if bad is not None:
        victim = updates[0 if bad == 0 else -1]
        if bad == 0:
            victim.upload["c"][2, 3] = float("nan")
        else:
            victim.state["v.b"][1] = float("inf")
    ledger = CommunicationLedger((), ("v.",), list(states), list(template))
    want_sums, want_rows, want_finite, want_counts = reference_collect(updates, active, glob, template, states)
    reports = RoundReports(4, cohort, active, updates, glob, template, states)
    got = Aggregation(ledger, "num_samples", "Algo").collect(reports, RoundStats())
    assert list(got.delta_sums) == list(template)
    for n in template:
        assert got.delta_sums[n].dtype == torch.float64 and torch.equal(got.delta_sums[n], want_sums[n]), n
    for n in states:
        assert got.state_rows[n].dtype == states[n].dtype and torch.equal(got.state_rows[n], want_rows[n]), n
    assert got.finite.tolist() == want_finite
    assert got.counts[[0, 2, 3, 4]].tolist() == [want_counts[i] for i in (0, 2, 3, 4)]
    assert_close_finite(got.counts[1], want_counts[1], rtol=1e-12, atol=0)


def test_collect_with_every_position_reporting_keeps_the_cohorts_rows_where_a_client_fails() -> None:
    """All positions active (the old rows are the cohort's rows as they are): a NaN client keeps its own row."""
    ups = three_clients()
    states = {"v": torch.arange(6, dtype=torch.float32).view(3, 2)}
    sums = Aggregation(ledger_for(TEMPLATE), "num_samples", "Algo").collect(
        RoundReports(0, [10, 11, 12], [0, 1, 2], ups, GLOB, TEMPLATE, states), RoundStats()
    )
    assert sums.state_rows["v"].tolist() == [[1.0, 1.0], [2.0, 3.0], [2.0, 2.0]]
    assert sums.state_rows["v"].data_ptr() != states["v"].data_ptr()  # new rows, the cohort's left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_rows_finite_is_isfinite_all_along_rows(dtype: torch.dtype) -> None:
    """A NaN, +inf or −inf anywhere in a row (every position of rows of 1 to 70 values) makes it non-finite."""
    for width in [1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 70]:
        base = torch.randn(3, width).to(dtype)
        assert rows_finite(base).tolist() == [True, True, True]
        for col in range(width):
            for value in (float("nan"), float("inf"), -float("inf")):
                x = base.clone()
                x[1, col] = value
                assert rows_finite(x).tolist() == torch.isfinite(x).all(1).tolist() == [True, False, True]
    assert rows_finite(torch.zeros(4, 0)).tolist() == [True] * 4


def test_all_finite_is_isfinite_of_every_tensor_whatever_the_dtypes() -> None:
    tensors = [torch.randn(5, 3), torch.randn(4, dtype=torch.float64), torch.tensor(3), torch.zeros(0), torch.randn(())]
    assert bool(all_finite(tensors)) and bool(all_finite(tensors[:1])) and bool(all_finite([]))
    for i in (0, 1, 4):
        for value in (float("nan"), float("inf"), -float("inf")):
            broken = [t.clone() for t in tensors]
            broken[i].view(-1)[-1] = value
            assert not bool(all_finite(broken))
            assert not all(bool(torch.isfinite(t).all()) for t in broken)
    assert all_finite(tensors).dim() == 0


def test_a_param_backup_restores_exactly_what_it_saved() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2).double())
    net[0].bias.requires_grad_(False)
    saved = {n: p.detach().clone() for n, p in net.named_parameters()}
    backup = ParamBackup((n, p) for n, p in net.named_parameters() if p.requires_grad)
    assert set(backup.tensors()) == {"0.weight", "1.weight", "1.bias"}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    backup.restore(net)
    for n, p in net.named_parameters():
        want = saved[n] + 1.0 if n == "0.bias" else saved[n]  # the frozen one is not backed up
        assert torch.equal(p.detach(), want), n


def test_check_finite_restores_the_backup_and_stops_with_the_round(tmp_path: Path) -> None:
    net = nn.Linear(2, 2)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    backup = ParamBackup(net.named_parameters())
    saved: list[str] = []
    trainer = SimpleNamespace(default_root_dir=str(tmp_path), save_checkpoint=saved.append)
    check_finite(net, backup, trainer, 3)  # finite: nothing happens
    with torch.no_grad():
        net.bias[1] = float("nan")
    from fl_lightning.engine.aggregation import TrainingDiverged

    with pytest.raises(TrainingDiverged, match="round 3: the global model became non-finite"):
        check_finite(net, backup, trainer, 3)
    assert all(torch.equal(p.detach(), before[n]) for n, p in net.named_parameters())  # restored, then saved
    assert saved == [str(tmp_path / "checkpoints" / "last_good_round00003.ckpt")]


def test_client_losses_are_as_tensors_would_make_them_then_float64() -> None:
    cpu = torch.device("cpu")
    floats = [0.1, 0.25, 1e-8]
    assert client_losses(floats, cpu).tolist() == [torch.as_tensor(v).double().item() for v in floats]
    tensors = [torch.tensor(0.1), torch.tensor([0.3]), torch.tensor(2.5)]
    assert client_losses(tensors, cpu).tolist() == [t.reshape(()).double().item() for t in tensors]
    mixed = [1, 0.5, torch.tensor(0.2, dtype=torch.float64)]
    assert client_losses(mixed, cpu).tolist() == [torch.as_tensor(v).reshape(()).double().item() for v in mixed]
    assert client_losses(floats, cpu).dtype == torch.float64


class OnlyReduceCopy:
    """A one-process strategy whose reduction returns a copy (as a real all-reduce's result is a new buffer)."""

    def reduce(self, tensor: Tensor, reduce_op: Any = "mean") -> Tensor:
        return tensor.clone()


def test_the_mean_of_the_reduced_buffer_is_each_sum_divided_by_the_weight() -> None:
    g = torch.Generator().manual_seed(0)
    template = {"a": torch.zeros(3, 2), "b": torch.zeros(()), "c": torch.zeros(5)}
    sums = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) * 1e3 for n, t in template.items()}
    reduced = CohortSums(dict(sums), {}, [], RoundStats(weight=7.0)).all_reduce(OnlyReduceCopy(), torch.device("cpu"))
    assert reduced.flat_sums is not None and reduced.flat_names == ("a", "b", "c")
    mean = reduced.mean_update(template)
    for n, t in template.items():
        want = sums[n].to(torch.float32) / torch.tensor(7.0, dtype=torch.float64)  # a 0-d one promotes to float64
        assert mean[n].dtype == want.dtype and mean[n].shape == t.shape and torch.equal(mean[n], want), n
    assert mean["a"].dtype == torch.float32 and mean["b"].dtype == torch.float64
    reduced.delta_sums.pop("b")  # names no longer those of the buffer (DP pops its count): tensor by tensor
    assert set(reduced.mean_update(template)) == {"a", "c"}
    mixed = {"a": torch.zeros(3, 2), "b": torch.zeros((), dtype=torch.long), "c": torch.zeros(5)}
    again = CohortSums(dict(sums), {}, [], RoundStats(weight=7.0)).all_reduce(OnlyReduceCopy(), torch.device("cpu"))
    mean = again.mean_update(mixed)
    assert mean["b"].dtype == torch.float64 and mean["b"].item() == sums["b"].item() / 7.0


def test_the_ledger_refuses_a_name_every_time_it_is_uploaded() -> None:
    ledger = CommunicationLedger((), ("v.",), (), ["w"])
    ledger.upload(0, 1, {"w": torch.zeros(2)})
    for _ in range(2):  # the names' kinds are matched once; the refusal stands
        with pytest.raises(PrivacyViolation, match="client 3 tried to upload 'v.x'"):
            ledger.upload(0, 3, {"w": torch.zeros(2), "v.x": torch.zeros(1)})
    assert ledger.upload_bytes == 8 and ledger.history[-1].uploads == 1


# ---- the communication ledger ----------------------------------------------------------------------------------

def test_communication_bytes_from_parameter_shapes(fedper_run):
    """FedPer on the 64→16→10 MLP uploads and downloads the body only: fc1 = 16·64 + 16 float32 values,
    i.e. 4,160 bytes per client, for the 4 sampled clients (20 clients × participation 0.2)."""
    body_bytes = 4 * (16 * 64 + 16)
    rows = [r for r in read_metrics(fedper_run / "metrics.csv") if "comm/upload_bytes" in r]
    assert len(rows) == ROUNDS
    for r in rows:
        assert r["comm/upload_bytes"] == 4 * body_bytes and r["comm/download_bytes"] == 4 * body_bytes


def test_ledger_rejects_a_personal_upload():
    class Leaky(FedRep):
        def client_update(self, ctx, global_params, state):
            upd = super().client_update(ctx, global_params, state)
            return ClientUpdate({**upd.upload, "head.weight": state["head.weight"]}, upd.state, upd.num_samples)

    module = FederatedModule(Leaky(1, 1), DigitsMLP(), eval_every=100)
    with pytest.raises(PrivacyViolation, match="head.weight"):
        fit(module, digits(), rounds=1)


def test_ledger_without_a_declaration_describes_nothing_beyond_the_upload() -> None:
    """A ledger built without ``reveals`` (and without side information) says the uploads reveal nothing beyond
    the declared upload."""
    ledger = CommunicationLedger(("head.",), (), set(), ["body.w"])
    assert ledger.describe() == "nothing beyond the declared upload"


W = torch.zeros(3, 4, dtype=torch.float32)  # 12 · 4 = 48 bytes


DC = torch.zeros(2, dtype=torch.float64)  # 2 · 8 = 16 bytes


B = torch.zeros(5, dtype=torch.float16)  # 5 · 2 = 10 bytes


def make_ledger(**kwargs) -> CommunicationLedger:
    args = dict(
        personal=("head.",),
        state_prefixes=("c_i.",),
        state_names={"c_i.body.w", "assign"},
        template={"body.w", "body.b", "delta_c.body.w"},
        reveals="the control-variate delta",
        state_dependent=("delta_c.",),
        side_dependent=("body.",),
        side_reveals="the side branch",
    )
    args.update(kwargs)
    return CommunicationLedger(**args)


def test_one_round_record_splits_bytes_by_declared_prefix():
    ledger = make_ledger()
    ledger.new_round(7)
    ledger.upload(7, 0, {"body.w": W, "delta_c.body.w": DC})
    ledger.upload(7, 3, {"body.b": B})
    record = ledger.history[-1]
    assert record.round == 7 and record.uploads == 2
    assert record.bytes == 48 + 16 + 10
    assert record.state_dependent_bytes == 16  # only the delta_c. upload
    assert record.side_dependent_bytes == 48 + 10  # the body. uploads
    assert ledger.upload_bytes == 48 + 16 + 10


def test_a_new_round_index_opens_a_new_record_and_new_round_resets_the_counters():
    ledger = make_ledger()
    ledger.upload(0, 0, {"body.w": W})  # no new_round call: the first upload opens round 0's record
    ledger.upload(1, 0, {"body.b": B})  # a different round index opens another one
    assert [(r.round, r.uploads, r.bytes) for r in ledger.history] == [(0, 1, 48), (1, 1, 10)]
    assert ledger.upload_bytes == 58  # the per-run counter keeps adding until new_round
    ledger.download({"body.w": W}, num_clients=3)
    assert ledger.download_bytes == 3 * 48
    ledger.new_round(2)
    assert ledger.upload_bytes == 0 and ledger.download_bytes == 0
    assert ledger.history[-1].round == 2 and ledger.history[-1].uploads == 0 and ledger.history[-1].bytes == 0
    ledger.upload(2, 1, {"delta_c.body.w": DC})
    assert len(ledger.history) == 3 and ledger.history[-1].bytes == 16 and ledger.upload_bytes == 16


def test_download_bytes_accumulate_per_receiving_client():
    ledger = make_ledger()
    ledger.new_round(0)
    ledger.download({"body.w": W, "body.b": B}, num_clients=4)
    ledger.download({"body.b": B}, num_clients=2)
    assert ledger.download_bytes == 4 * (48 + 10) + 2 * 10


def test_private_names_are_personal_prefixes_state_prefixes_and_exact_bank_names():
    ledger = make_ledger()
    assert ledger.is_private("head.w") and ledger.is_private("c_i.anything") and ledger.is_private("assign")
    assert not ledger.is_private("assignment")  # a bank name is matched exactly, not as a prefix
    assert not ledger.is_private("body.w") and not ledger.is_private("delta_c.body.w")
    with pytest.raises(PrivacyViolation, match="'assign'"):
        make_ledger(template={"body.w", "assign"})
    with pytest.raises(PrivacyViolation, match="'head.w'"):
        make_ledger(template={"head.w"})
    with pytest.raises(PrivacyViolation, match="'c_i.x'"):
        make_ledger(template={"c_i.x"})
    ledger.new_round(0)
    with pytest.raises(PrivacyViolation, match="client 5 tried to upload 'body.extra' in round 0"):
        ledger.upload(0, 5, {"body.w": W, "body.extra": B})  # outside the declared template


def test_observers_see_every_upload_with_its_round_and_client(monkeypatch):
    ledger = make_ledger()
    local, everywhere = [], []
    ledger.observers.append(lambda r, c, t: local.append((r, c, sorted(t))))
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda led, r, c, t: everywhere.append((led, r, c))])
    returned = ledger.upload(4, 9, {"body.w": W})
    assert set(returned) == {"body.w"} and returned["body.w"] is W
    assert local == [(4, 9, ["body.w"])]
    assert everywhere == [(ledger, 4, 9)]


def test_describe_joins_the_declarations():
    assert make_ledger().describe() == "the control-variate delta; the side branch"
    assert make_ledger(side_reveals=None).describe() == "the control-variate delta"
    assert make_ledger(reveals="", side_reveals=None).describe() == "nothing beyond the declared upload"


@pytest.mark.parametrize("side_reveals", [None, "the side branch"])
def test_for_algorithm_reads_each_declaration_into_its_role(side_reveals):
    algorithm = SimpleNamespace(
        personal=("head.",),
        state_prefixes=("v.",),
        reveals="its personal model's distance",
        state_dependent_uploads=("delta.",),
        side_dependent_uploads=("body.",),
    )
    ledger = CommunicationLedger.for_algorithm(algorithm, {"bank"}, {"body.w", "delta.x"}, side_reveals)
    assert ledger.personal == ("head.",) and ledger.state_prefixes == ("v.",)
    assert ledger.state_names == frozenset({"bank"}) and ledger.allowed == frozenset({"body.w", "delta.x"})
    assert ledger.reveals == "its personal model's distance" and ledger.side_reveals == side_reveals
    assert ledger.state_dependent == ("delta.",)
    assert ledger.side_dependent == (("body.",) if side_reveals is not None else ())


def test_tensor_bytes_is_elements_times_their_size_per_dtype():
    """4 bytes per float32, 8 per float64, 2 per float16, 1 per bool; an empty upload is 0 bytes."""
    tensors = {"a": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.float64), "c": torch.zeros(5, dtype=torch.half),
               "d": torch.zeros(7, dtype=torch.bool)}  # fmt: skip
    assert tensor_bytes(tensors) == 12 * 4 + 2 * 8 + 5 * 2 + 7 * 1
    assert tensor_bytes({}) == 0
