"""Spec 001's simulation with all seeds as one batched job gives every number of the per-seed loop."""

from __future__ import annotations

import itertools

import pytest
import torch

from experiments import mixed_regression as mr


def test_batched_seeds_equal_the_per_seed_loop():
    kwargs = dict(dim=12, sizes="20x12,6x30", probs=[0.5, 0.3, 0.2], methods=(*mr.METHODS, "ours_disjoint"))
    seeds = [0, 3, 5]
    batched = mr.run_seeds("custom", seeds, 15, 0.05, 5, **kwargs)
    for s in seeds:
        alone = mr.run_seed("custom", s, 15, 0.05, 5, **kwargs)
        assert set(batched[s]) == set(alone) == {*mr.METHODS, "ours_disjoint"}
        for method, ref in alone.items():
            got = batched[s][method]
            assert len(got["curve"]) == len(ref["curve"]) > 15
            assert got["curve"] == ref["curve"], method  # the same floats, not only close ones
            assert (got["final"], got["cluster_error"]) == (ref["final"], ref["cluster_error"]), method


@pytest.mark.parametrize("k_hat", [1, 2, 3, 4])
def test_seed_distances_are_the_minimax_over_assignments(k_hat):
    g = torch.Generator().manual_seed(k_hat)
    theta, star = torch.randn(5, k_hat, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, 4, generator=g)
    got = mr.seed_distances(theta, star)
    for s in range(5):  # brute force, written out: every map of the 3 true clusters to models
        dist = [[float((theta[s, i] - star[s, j].double()).norm()) for j in range(3)] for i in range(k_hat)]
        maps = itertools.permutations(range(k_hat), 3) if k_hat >= 3 else itertools.product(range(k_hat), repeat=3)
        best = min(max(dist[m[j]][j] for j in range(3)) for m in maps)
        assert got[s] == pytest.approx(best, rel=1e-12)
        assert got[s] == mr.permutation_distance(theta[s], star[s])[0]
