"""``fl_lightning/experiment/run_axis/shared_data.py``: the runs of a job share one copy of the rows and keep their
own partition, on the host and after a move."""

from __future__ import annotations

import torch

from datamodules import DigitsDataModule, Shards
from fl_lightning.experiment.run_axis.shared_data import RowPool, SharedRowsSplit


def test_runs_share_one_copy_of_the_rows_and_keep_their_own_partition():
    feds = []
    for seed in (0, 1):
        data = DigitsDataModule(num_clients=10, partition=Shards(2), seed=seed)
        data.setup()
        feds.append(data.federated)
    pool = RowPool()
    shared = [pool.share(f) for f in feds]
    assert pool.rows() <= 1797  # the digits' images, once (the two seeds split them differently)
    for fed, mine in zip(feds, shared):
        for split in ("train", "test"):
            a, b = getattr(fed, split), getattr(mine, split)
            assert isinstance(b, SharedRowsSplit) and torch.equal(a.x, b.x) and torch.equal(a.ptr, b.ptr)
            for c in (0, 4, 9):
                assert torch.equal(a.client(c)[0], b.client(c)[0]) and torch.equal(a.client(c)[1], b.client(c)[1])
    moved = [s.to("cpu") for s in shared]
    assert moved[0].train.pool.on("cpu").data_ptr() == moved[1].test.pool.on("cpu").data_ptr()
