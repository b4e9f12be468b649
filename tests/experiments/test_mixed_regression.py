"""Spec 001 (``experiments/mixed_regression.py``): mixed regression data, FedMD (Phase 1), FedX with clustering
(Phase 2), IFCA and one-shot clustering against references, and all seeds as one batched job."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from datamodules.mixed_regression import (
    MixedRegressionDataModule,
    mixed_regression_problem,
)
from experiments import mixed_regression as mr
from fl_lightning.algorithms import IFCA, FedMD, OneShotClustering
from fl_lightning.algorithms.ifca import assign_clusters, fedx_round
from fl_lightning.algorithms.moment_descent import anchor_step, group_anchors, pair_moment, pair_products, top_subspace
from fl_lightning.algorithms.oneshot_kmeans import local_estimate
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import ClusteredLinear
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import fit

SMALL_SIZES = [4] * 24 + [20] * 8


SMALL_PROBS = [0.5, 0.5]


# CLI overrides that shrink configs/mixed_regression/{c1,fedmd}.yaml to CI size (also used by the DDP test)
SMALL_FEDMD_ARGS = [
    "--data.init_args.sizes",
    str(SMALL_SIZES),
    "--data.init_args.probs",
    str(SMALL_PROBS),
    "--data.init_args.dim",
    "6",
    "--model.network.init_args.dim",
    "6",
    "--model.network.init_args.num_clusters",
    "2",
    "--model.algorithm.init_args.num_anchors",
    "3",
    "--model.algorithm.init_args.phase1_iters",
    "2",
]


def small_problem(seed: int = 0, dim: int = 6, noise: float = 0.1) -> dict:
    return mixed_regression_problem(SMALL_SIZES, SMALL_PROBS, dim, noise, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("solver", ["gd", "prox"])
def test_one_fedx_round_is_lemma_1(solver):
    """One round equals eq. (11): θ_j − (η/N) Σ_{z_i=j} X_iᵀ P_i (X_iθ_j − y_i), P_i as n_i×n_i matrices."""
    p = small_problem()
    groups, ids = mr.client_groups(p)
    theta = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lr, s = 0.05, 3
    new, chosen = fedx_round(groups, theta, lr, s, solver)
    x, y, ptr, n_total = p["x"].numpy(), p["y"].numpy(), p["ptr"].numpy(), len(p["x"])
    th = theta.numpy()
    ref = th.copy()
    for c in range(len(SMALL_SIZES)):
        xi, yi = x[ptr[c] : ptr[c + 1]], y[ptr[c] : ptr[c + 1]]
        n = len(yi)
        z = int(np.argmin([np.sum((yi - xi @ th[j]) ** 2) for j in range(2)]))
        a = np.eye(n) - lr * xi @ xi.T / n
        pmat = sum(np.linalg.matrix_power(a, ell) for ell in range(s))
        if solver == "prox":
            pmat = np.linalg.inv(np.eye(n) + lr * xi @ xi.T / n)
        ref[z] -= (lr / n_total) * xi.T @ pmat @ (xi @ th[z] - yi)
    assert_close_finite(new.numpy(), ref, rtol=1e-5, atol=1e-12)
    affine = mr.AffineFedX(groups, 2, lr, s, solver)
    assert_close_finite(affine.round(theta)[0], new, rtol=1e-5, atol=1e-12)


def test_pair_moments_and_products_against_loops():
    rng = np.random.default_rng(0)
    x, y, models, q = rng.normal(size=(7, 4)), rng.normal(size=7), rng.normal(size=(2, 4)), rng.normal(size=(4, 3))
    e = [(y - x @ m)[:, None] * x for m in models]
    disjoint = np.stack([sum(np.outer(ei[2 * j], ei[2 * j + 1]) for j in range(3)) for ei in e])
    allp = np.stack([sum(np.outer(ei[a], ei[b]) for a in range(7) for b in range(7) if a != b) for ei in e])
    t = [torch.tensor(v) for v in (x, y, models, q)]
    assert_close_finite(pair_moment(*t[:3], "disjoint").numpy(), disjoint, rtol=1e-5, atol=1e-8)
    assert_close_finite(pair_moment(*t[:3], "all").numpy(), allp, rtol=1e-5, atol=1e-8)
    assert_close_finite(pair_products(*t, False, "disjoint").numpy(), disjoint @ q, rtol=1e-5, atol=1e-8)
    want = disjoint.transpose(0, 2, 1) @ q
    assert_close_finite(pair_products(*t, True, "disjoint").numpy(), want, rtol=1e-5, atol=1e-8)
    assert_close_finite(pair_products(*t, True, "all").numpy(), allp @ q, rtol=1e-5, atol=1e-8)


def test_anchor_step_halves_the_error_with_exact_moments():
    """Noise-free, many points, basis spanning θ* − θ: σ̂ ≈ ‖θ* − θ‖ and the step goes half way."""
    g = torch.Generator().manual_seed(0)
    d, n = 5, 20000
    star, theta = torch.randn(d, generator=g, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    basis = torch.linalg.qr(torch.stack([star, torch.randn(d, generator=g, dtype=torch.float64)], 1))[0]
    for pairing, power in [("all", 0), ("disjoint", 30)]:
        new, sigma = anchor_step(x, x @ star, theta, basis, power, 0.5, 0.0, pairing)
        assert sigma == pytest.approx(float(star.norm()), rel=0.05)
        assert float((new - star).norm()) == pytest.approx(0.5 * float(star.norm()), rel=0.1)
        assert anchor_step(x, x @ star, theta, basis, power, 0.5, 2 * sigma, pairing)[0] is theta  # stop test


def test_group_anchors_threshold_and_fallback():
    models = torch.tensor([[0.0, 0], [0.1, 0], [5, 5], [5.1, 5], [10, 0]], dtype=torch.float64)
    labels, centres = group_anchors(models, 3, delta=2.0)
    assert len(set(labels.tolist())) == 3 and labels[0] == labels[1] and labels[2] == labels[3]
    assert sorted(centres[:, 0].tolist()) == pytest.approx([0.05, 5.05, 10.0])
    labels2, _ = group_anchors(models, 3, delta=0.05)  # 5 groups at Δ/2: cut at k instead
    assert torch.equal(labels2, labels)


def test_orthogonal_iteration_recovers_the_svd_subspace():
    p = small_problem(noise=0.5)
    models = torch.randn(2, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    total = sum(
        pair_moment(p["x"][p["ptr"][c] : p["ptr"][c + 1]], p["y"][p["ptr"][c] : p["ptr"][c + 1]], models)
        for c in range(len(SMALL_SIZES))
    )
    u = torch.linalg.svd(total)[0][..., :2]
    q = torch.linalg.qr(torch.randn(2, 6, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64))[0]
    for step in range(200):
        agg = sum(
            pair_products(
                p["x"][p["ptr"][c] : p["ptr"][c + 1]], p["y"][p["ptr"][c] : p["ptr"][c + 1]], models, q, step % 2 == 0
            )
            for c in range(len(SMALL_SIZES))
        )
        q = agg if step % 2 == 0 else torch.linalg.qr(agg)[0]
    assert_close_finite(q @ q.transpose(1, 2), u @ u.transpose(1, 2), rtol=1e-5, atol=1e-6)


def engine_run(algorithm, rounds: int, num_clusters: int = 2, seed: int = 0) -> FederatedModule:
    dm = MixedRegressionDataModule(sizes=SMALL_SIZES, probs=SMALL_PROBS, dim=6, noise=0.1, seed=seed)
    net = ClusteredLinear(num_clusters, 6, seed=seed + 1)
    module = FederatedModule(algorithm, net, aggregation="num_samples", eval_every=1000, eval_last=1)
    return fit(module, dm, rounds, seed)


@pytest.mark.parametrize("subspace", ["svd", "orthogonal"])
def test_fedmd_in_the_engine_equals_the_reference(subspace):
    algo = FedMD(
        num_anchors=3,
        phase1_iters=2,
        subspace=subspace,
        orth_iters=60,
        anchor_min_samples=20,
        seed=0,
        local_steps=3,
        lr=0.05,
    )
    module = engine_run(algo, algo.warmup_rounds + 6)
    p = small_problem()
    groups, ids = mr.client_groups(p)
    init = ClusteredLinear(2, 6, seed=1).theta.detach()
    theta, _, anchors = mr.fedmd_phase1(p, groups, init[0], 2, 2, seed=0, num_anchors=3)
    assert torch.equal(algo.anchor_ids, anchors)
    ref, _, chosen = mr.run_phase2(groups, theta, p["theta_star"], 6, 0.05, 3)
    tol = 1e-9 if subspace == "svd" else 1e-5  # Algorithm 3 converges to the SVD subspace
    assert_close_finite(module.net.theta.detach(), ref, rtol=1e-5, atol=tol)
    labels = module.bank.row("label").long()
    for g, z in zip(ids, chosen):
        assert torch.equal(labels[g], z)


def test_ifca_fedavg_and_oneshot_in_the_engine_equal_the_reference():
    p = small_problem()
    groups, ids = mr.client_groups(p)
    init = ClusteredLinear(2, 6, seed=1).theta.detach()
    module = engine_run(IFCA(local_steps=2, lr=0.1), 5)
    ref = mr.run_phase2(groups, init, p["theta_star"], 5, 0.1, 2)[0]
    assert_close_finite(module.net.theta.detach(), ref, rtol=1e-5, atol=1e-8)
    module = engine_run(IFCA(local_steps=2, lr=0.1, solver="prox"), 4, num_clusters=1)
    ref = mr.run_phase2(groups, ClusteredLinear(1, 6, seed=1).theta.detach(), p["theta_star"], 4, 0.1, 2, "prox")[0]
    assert_close_finite(module.net.theta.detach(), ref, rtol=1e-5, atol=1e-8)
    module = engine_run(OneShotClustering(seed=0, local_steps=2, lr=0.1), 4)
    est = torch.stack(
        [
            torch.tensor(
                np.linalg.lstsq(
                    p["x"][p["ptr"][c] : p["ptr"][c + 1]].numpy(),
                    p["y"][p["ptr"][c] : p["ptr"][c + 1]].numpy(),
                    rcond=None,
                )[0]
            )
            for c in range(len(SMALL_SIZES))
        ]
    )
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=2, n_init=10, random_state=0).fit(est.numpy())
    assert torch.equal(module.algorithm.labels, torch.as_tensor(km.labels_, dtype=torch.long))
    fixed = [module.algorithm.labels[g] for g in ids]
    ref = mr.run_phase2(groups, torch.tensor(km.cluster_centers_), p["theta_star"], 3, 0.1, 2, labels=fixed)[0]
    assert_close_finite(module.net.theta.detach(), ref, rtol=1e-5, atol=1e-8)


def test_small_run_recovers_the_models_and_fedavg_does_not():
    """CI-size C.1-like draw: FedMD reaches the oracle's error, global FedAvg stays ~Δ away."""
    out = mr.run_seed("C1", 0, 150, 0.05, 5, dim=20, methods=("ours", "fedavg", "oracle"))
    assert out["ours"]["final"] <= 2 * out["oracle"]["final"]
    assert out["fedavg"]["final"] > 10 * out["ours"]["final"]
    assert out["ours"]["cluster_error"] == 0.0


def test_bad_configs_fail_with_one_line():
    with pytest.raises(ConfigError, match="setting"):
        MixedRegressionDataModule(setting="C9")
    with pytest.raises(ConfigError, match="even"):
        FedMD(subspace="orthogonal", orth_iters=3)
    with pytest.raises(ConfigError, match="anchors needed"):
        engine_run(FedMD(num_anchors=9, anchor_min_samples=20), 2)


def test_train_py_resume_gives_identical_results(tmp_path):
    from fl_lightning.cli import train_config

    common = [
        *SMALL_FEDMD_ARGS,
        "--model.eval_every",
        "5",
        "--checkpoint_every",
        "4",
        "--trainer.enable_checkpointing",
        "true",
    ]
    cfg = ["configs/mixed_regression/c1.yaml", "configs/mixed_regression/fedmd.yaml"]
    full = train_config(cfg, [*common, "--trainer.max_steps", "12"], tmp_path / "full")
    train_config(cfg, [*common, "--trainer.max_steps", "8"], tmp_path / "part")
    resumed = train_config(cfg, [*common, "--trainer.max_steps", "12", "--ckpt_path", "last"], tmp_path / "part")
    assert full["rounds"] == resumed["rounds"] == 12 and full["final"] == resumed["final"]
    a = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "part" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "algorithm.anchor_models" in a and "bank.label" in a
    metrics = (tmp_path / "part" / "metrics.csv").read_text()
    assert "mr/dist_theta" in metrics and "mr/cluster_error" in metrics


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


def test_fixed_labels_override_the_argmin_choice():
    p = small_problem()
    groups, _ = mr.client_groups(p)
    theta = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = [1 - assign_clusters(x, y, theta) for x, y, _ in groups]  # every client the other cluster
    lr, s = 0.05, 3
    new, chosen = fedx_round(groups, theta, lr, s, "gd", labels=labels)
    assert all(torch.equal(c, z) for c, z in zip(chosen, labels))
    x, y, ptr, n_total = p["x"].numpy(), p["y"].numpy(), p["ptr"].numpy(), len(p["x"])
    th = theta.numpy()
    ref = th.copy()
    for c in range(len(SMALL_SIZES)):
        xi, yi = x[ptr[c] : ptr[c + 1]], y[ptr[c] : ptr[c + 1]]
        n = len(yi)
        z = 1 - int(np.argmin([np.sum((yi - xi @ th[j]) ** 2) for j in range(2)]))
        a = np.eye(n) - lr * xi @ xi.T / n
        pmat = sum(np.linalg.matrix_power(a, ell) for ell in range(s))
        ref[z] -= (lr / n_total) * xi.T @ pmat @ (xi @ th[z] - yi)
    assert_close_finite(new.numpy(), ref, rtol=1e-5, atol=1e-12)


def test_chosen_clusters_are_returned_per_group():
    p = small_problem()
    groups, _ = mr.client_groups(p)
    theta = torch.randn(2, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, chosen = fedx_round(groups, theta, 0.05, 1)
    assert len(chosen) == len(groups)
    th = theta.numpy()
    for (x, y, _), z in zip(groups, chosen):  # eq. (8) in numpy: the row with the smallest squared residual
        residual = ((y.numpy()[..., None] - x.numpy() @ th.T) ** 2).sum(1)
        assert z.tolist() == residual.argmin(-1).tolist()
