"""``CohortSums.all_reduce`` over two real ranks: this pytest process is rank 0 and a Python subprocess is rank 1,
joined by a gloo process group on a free local port, each with a Lightning ``DDPStrategy`` (its own ``reduce`` and
``all_gather``, as a DDP trainer gives them). The reduced sums and statistics are the two ranks' hand-added sums,
and every rank gets every state row in layout order."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_close_finite
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy

import fl_lightning
from fl_lightning.engine.aggregation import CohortSums, RoundStats

HERE = Path(__file__).resolve().parent
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
        "PYTHONPATH": os.pathsep.join([str(Path(fl_lightning.__file__).parents[1]), str(HERE)]),
        "MUTANT_UNDER_TEST": "" if mutant in ("stats", "fail") else mutant,
    }
    code = f"import test_mut_allreduce_two_ranks as t; t.rank_one({store.port}, {str(out)!r})"
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
