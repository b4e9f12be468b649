"""Spec 001's simulation with all seeds as one batched job gives every number of the per-seed loop."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import assert_close_finite

from datamodules.mixed_regression import mixed_regression_problem
from experiments import mixed_regression as mr
from fl_lightning.algorithms.ifca import assign_clusters
from fl_lightning.algorithms.moment_descent import top_subspace
from fl_lightning.algorithms.oneshot_kmeans import local_estimate


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
            assert got["cluster_error"] == ref["cluster_error"], method  # the same assignments
            # the same numbers up to float64 rounding (sums taken in another order)
            assert_close_finite(got["curve"], ref["curve"], rtol=0, atol=1e-12, msg=method)
            assert_close_finite(got["final"], ref["final"], rtol=0, atol=1e-12, msg=method)


def test_assignment_bounds_skip_only_unchanged_choices():
    """IFCA from a random start: every round's assignments equal ``assign_clusters`` on every client, though
    most clients' residuals were not computed."""
    seeds, k, dim = [0, 1, 2], 3, 8
    problems = [mixed_regression_problem([12] * 30, [1 / 3] * 3, dim, 0.2, torch.Generator().manual_seed(s))
                for s in seeds]  # fmt: skip
    groups = [mr.client_groups(p)[0] for p in problems]
    fedx = mr.SeedsFedX([mr.AffineFedX(g, k, 0.05, 5) for g in groups])
    theta = 0.3 * torch.randn(len(seeds), k, dim, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    fedx.start(k)
    rounds = 40
    for _ in range(rounds):
        want = torch.stack([assign_clusters(g[0][0], g[0][1], t) for g, t in zip(groups, theta)])
        theta, chosen = fedx.round(theta)
        assert torch.equal(chosen[0], want)
    clients = len(seeds) * 30
    assert clients < fedx.evaluated < rounds * clients // 2  # recomputed after the first round, skipped mostly


def test_least_squares_from_the_shared_svds_are_local_estimate():
    p = mixed_regression_problem([7] * 5 + [15] * 4, [0.5, 0.5], 10, 0.1, torch.Generator().manual_seed(4))
    groups, ids = mr.client_groups(p)
    got = mr.least_squares_seeds([mr.AffineFedX(groups, 2, 0.05, 5)], ids, 9)[0]
    ptr = p["ptr"]
    want = torch.stack([local_estimate(p["x"][ptr[c] : ptr[c + 1]], p["y"][ptr[c] : ptr[c + 1]]) for c in range(9)])
    assert_close_finite(got, want, rtol=0, atol=1e-14)


def test_gram_svd_is_the_thin_svd_and_falls_back_to_it():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 5, 12, generator=g, dtype=torch.float64)
    u, sv, wt = mr.gram_svd(wide)
    ref_u, ref_sv, ref_wt = torch.linalg.svd(wide, full_matrices=False)
    assert_close_finite(sv, ref_sv, rtol=1e-13, atol=0)
    assert_close_finite(u @ torch.diag_embed(sv) @ wt, wide, rtol=0, atol=1e-13)
    eye = torch.eye(5, dtype=torch.float64).expand(6, 5, 5)
    assert_close_finite(u.mT @ u, eye, rtol=0, atol=1e-13)
    assert_close_finite(wt @ wt.mT, eye, rtol=0, atol=1e-13)
    lam = ref_sv.square().unsqueeze(-2)  # AffineFedX's terms W h(λ) Wᵀ do not see the singular pairs' signs
    assert_close_finite((wt.mT * sv.square().unsqueeze(-2)) @ wt, (ref_wt.mT * lam) @ ref_wt, rtol=0, atol=1e-12)
    tall = torch.randn(3, 12, 5, generator=g, dtype=torch.float64)
    ill = wide.clone()
    ill[0] = torch.linalg.qr(wide[0].mT)[0].mT * torch.logspace(0, -3, 5, dtype=torch.float64).unsqueeze(-1)
    for x in (tall, ill):  # the SVD itself: tall clients, and a group with cond(X) > 10
        for got, want in zip(mr.gram_svd(x), torch.linalg.svd(x, full_matrices=False)):
            assert torch.equal(got, want)


def test_symmetric_top_subspace_spans_the_top_singular_vectors():
    g = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(torch.randn(2, 9, 9, generator=g, dtype=torch.float64))[0]
    values = torch.tensor([9.0, -7, 5, 1, -0.5, 0.3, 0.2, -0.1, 0.05], dtype=torch.float64)  # indefinite
    y = q @ torch.diag(values) @ q.mT
    got, want = mr.symmetric_top_subspace(y, 3), top_subspace(y, 3)
    assert_close_finite(got @ got.mT, want @ want.mT, rtol=0, atol=1e-12)


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
