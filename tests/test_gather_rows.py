"""``gather_rows`` (aggregation): every rank sends only its own clients' state rows, and every rank gets all of them
in the same order. Two ranks are two threads here, joined by an all-gather built from a barrier, so the function
runs unchanged without DDP (the DDP tests run it in subprocesses, out of the fast selection)."""

from __future__ import annotations

import threading

import torch

from fl_lightning.engine.aggregation import gather_rows


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
