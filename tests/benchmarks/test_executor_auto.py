"""``benchmarks/executor_auto.py``: its synthetic clients (shapes, offsets, seeded) and one measurement on them
(both paths timed on the same cohorts, both evaluations timed)."""

from __future__ import annotations

import torch

from benchmarks.executor_auto import measure, synthetic
from fl_lightning.algorithms import FedAvg


def test_synthetic_clients_have_their_rows_and_are_seeded():
    fed = synthetic(3, 8, seed=4)
    assert fed.num_clients == 3 and fed.num_classes == 10 and fed.seed == 4
    assert fed.train.x.shape == (24, 64) and fed.train.sizes.tolist() == [8, 8, 8]
    assert fed.test.sizes.tolist() == [2, 2, 2]  # a quarter of the training rows, at least one
    assert synthetic(2, 2).test.sizes.tolist() == [1, 1]
    again = synthetic(3, 8, seed=4)
    assert torch.equal(fed.train.x, again.train.x) and torch.equal(fed.test.y, again.test.y)
    assert not torch.equal(fed.train.x, synthetic(3, 8, seed=5).train.x)
    assert int(fed.train.y.min()) >= 0 and int(fed.train.y.max()) <= 9


def test_one_measurement_times_both_paths_and_both_evaluations():
    out = measure(synthetic(3, 10), lambda: FedAvg(1), per_round=2, rounds=2)
    assert set(out) == {"sequential", "vectorized", "eval sequential", "eval vectorized"}
    assert all(v > 0 for v in out.values()), out


def test_temporaries_times_the_three_ways_of_one_subtraction():
    import math

    from benchmarks.executor_auto import temporaries

    spent = temporaries(shape=(3, 8, 16), repeats=2)
    assert set(spent) == {"fresh", "preallocated", "per client"}
    assert all(math.isfinite(t) and t >= 0 for t in spent.values())


def test_conv_rows_time_both_paths_per_method_and_client_size(capsys):
    """``--conv``: one row per (images per client, method) with its minibatches per epoch (batch 10) and ratio."""
    from benchmarks.executor_auto import conv_minibatches

    conv_minibatches(rounds=1, methods=["FedRep", "FedAvg"], samples=[10, 11])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("FedRep", "1"), ("FedAvg", "1"), ("FedRep", "2"), ("FedAvg", "2")]
    for r in rows:
        seq, stacked, ratio = (float(v) for v in r[2:])
        assert seq > 0 and stacked > 0 and abs(ratio - seq / stacked) < 0.01 + 0.01 * ratio, r
