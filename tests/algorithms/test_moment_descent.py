"""FedMD (moment descent) (spec 001 Phase 1; ``fl_lightning/algorithms/moment_descent.py``) against references written
here: its arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from torch.nn import functional as F

from fl_lightning.algorithms import FedMD
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.algorithms.moment_descent import anchor_step, default_num_anchors, group_anchors
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import ClusteredLinear
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context


# ---- FedMD Phase 1 against numpy ------------------------------------------------------------------------------
def numpy_fedmd_phase1(xs, ys, anchor_ids, theta0, k, iters, step_scale=0.5):
    """Spec 001 §2.1 written out in numpy with explicit loops over point pairs: per iteration, for every anchor
    model θ_h, Y_h = Σ_clients Σ_{a≠b} e_a e_bᵀ with e = (y − xᵀθ_h)x, Û_h = its top-k left singular vectors;
    then anchor h (client anchor_ids[h]) forms A = Σ_{a≠b} (Ûᵀe_a)(Ûᵀe_b)ᵀ / (n(n−1)) on its own points,
    σ̂ = √σ₁(A), β̂ = the top left singular vector, Ûβ̂ oriented along Σ e, and moves θ_h += step_scale·σ̂·Ûβ̂.
    Finally single linkage merges the closest anchor groups until k remain; the group means are returned."""

    def residuals(x, y, theta):
        return (y - x @ theta)[:, None] * x

    def pair_sum(rows):
        total = np.zeros((rows.shape[1], rows.shape[1]))
        for a in range(len(rows)):
            for b in range(len(rows)):
                if a != b:
                    total += np.outer(rows[a], rows[b])
        return total

    models = np.repeat(theta0[None], len(anchor_ids), axis=0)
    for _ in range(iters):
        bases = []
        for theta in models:
            y_h = sum(pair_sum(residuals(x, y, theta)) for x, y in zip(xs, ys))
            bases.append(np.linalg.svd(y_h)[0][:, :k])
        new = models.copy()
        for h, (client, theta, basis) in enumerate(zip(anchor_ids, models, bases)):
            e = residuals(xs[client], ys[client], theta)
            n = len(e)
            a = pair_sum(e @ basis) / (n * (n - 1))
            u, s, _ = np.linalg.svd(a)
            direction = basis @ u[:, 0]
            if direction @ e.sum(0) < 0:
                direction = -direction
            new[h] = theta + step_scale * np.sqrt(s[0]) * direction
        models = new
    groups = [[h] for h in range(len(models))]
    while len(groups) > k:  # single linkage: merge the two groups with the closest members
        pairs = [(i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))]
        i, j = min(
            pairs,
            key=lambda p: min(np.linalg.norm(models[a] - models[b]) for a in groups[p[0]] for b in groups[p[1]]),
        )
        groups[i] += groups.pop(j)
    return models, np.stack([models[g].mean(0) for g in groups])


def test_fedmd_phase1_in_the_engine_matches_a_numpy_implementation():
    from datamodules import MixedRegressionDataModule
    from fl_lightning.algorithms import FedMD
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import ClusteredLinear
    from tests.helpers.training import fit

    sizes = [4] * 24 + [20] * 8
    dm = MixedRegressionDataModule(sizes=sizes, probs=[0.5, 0.5], dim=6, noise=0.1, seed=0)
    algo = FedMD(num_anchors=3, phase1_iters=2, subspace="svd", anchor_min_samples=20, seed=0)
    module = FederatedModule(algo, ClusteredLinear(2, 6, seed=1), aggregation="num_samples", eval_every=1000)
    theta0 = module.net.theta.detach()[0].numpy().copy()
    fit(module, dm, algo.warmup_rounds)  # registration + 2 × (subspace, anchor): Phase 1 only
    train = dm.federated.train
    xs = [train.client(c)[0].double().numpy() for c in range(train.num_clients)]
    ys = [train.client(c)[1].double().numpy() for c in range(train.num_clients)]
    anchors = algo.anchor_ids.tolist()
    assert len(set(anchors)) == 3 and all(len(xs[c]) >= 20 for c in anchors)  # drawn among the eligible clients
    models, centres = numpy_fedmd_phase1(xs, ys, anchors, theta0, k=2, iters=2)
    assert np.isfinite(models).all() and np.abs(models - theta0).max() > 1e-2  # the anchors moved
    assert_close_finite(algo.anchor_models.numpy(), models, rtol=1e-8, atol=1e-10)
    got = module.net.theta.detach().numpy()
    order = lambda m: m[np.lexsort(m.T[::-1])]  # noqa: E731 (group labels may be numbered differently)
    assert_close_finite(order(got), order(centres), rtol=1e-8, atol=1e-10)


def np_anchor_step(x, y, theta, basis, power_iters, step_scale, threshold, pairing):
    e = (y - x @ theta)[:, None] * x
    p = e @ basis
    k = basis.shape[1]
    amat = np.zeros((k, k))
    if pairing == "disjoint":
        m = len(e) // 2
        for j in range(m):
            amat += np.outer(p[2 * j], p[2 * j + 1])
        amat /= max(m, 1)
    else:
        n = len(e)
        for a in range(n):
            for b in range(n):
                if a != b:
                    amat += np.outer(p[a], p[b])
        amat /= max(n * (n - 1), 1)
    if power_iters:
        gram = amat @ amat.T
        beta = np.ones(k) / np.sqrt(k)
        for _ in range(power_iters):
            beta = gram @ beta
            beta = beta / max(np.linalg.norm(beta), 1e-300)  # A = 0 (no pair): β stays 0
        top = np.sqrt(abs(beta @ gram @ beta))
    else:
        u, s, _ = np.linalg.svd(amat)
        beta, top = u[:, 0], s[0]
    sigma = np.sqrt(top)
    direction = basis @ beta
    if direction @ e.sum(0) < 0:
        direction = -direction
    if sigma <= threshold:
        return theta, sigma
    return theta + step_scale * sigma * direction, sigma


def anchor_problem(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    d, k = 5, 3
    star, theta = rng.normal(size=d), rng.normal(size=d) * 0.3
    x = rng.normal(size=(n, d))
    y = x @ star + 0.1 * rng.normal(size=n)
    basis = np.linalg.qr(rng.normal(size=(d, k)))[0]
    return x, y, theta, basis


@pytest.mark.parametrize("pairing", ["all", "disjoint"])
@pytest.mark.parametrize("power_iters", [0, 1, 3])
@pytest.mark.parametrize("n", [9, 3, 1])  # 3 points: one disjoint pair; one point: no pair, A = 0 (a zero step)
def test_anchor_step_equals_the_numpy_reference(pairing, power_iters, n):
    x, y, theta, basis = anchor_problem(n)
    new, sigma = anchor_step(*(torch.tensor(v) for v in (x, y, theta, basis)), power_iters, 0.7, 0.0, pairing)
    ref, ref_sigma = np_anchor_step(x, y, theta, basis, power_iters, 0.7, 0.0, pairing)
    assert sigma == pytest.approx(ref_sigma, rel=1e-10, abs=1e-12)
    assert_close_finite(new, ref, rtol=1e-10, atol=1e-12)
    if n > 1:
        assert float(np.abs(ref - theta).max()) > 1e-3


@pytest.mark.parametrize("pairing", ["all", "disjoint"])
def test_anchor_step_stops_at_the_threshold_only_when_sigma_is_not_above_it(pairing):
    x, y, theta, basis = anchor_problem(10, seed=1)
    t = [torch.tensor(v) for v in (x, y, theta, basis)]
    _, sigma = anchor_step(*t, 0, 0.5, 0.0, pairing)
    for threshold in (sigma, sigma * (1 + 1e-9)):  # σ̂ > εΔ moves: σ̂ = εΔ stops
        stopped, _ = anchor_step(*t, 0, 0.5, threshold, pairing)
        assert torch.equal(stopped, t[2])
    moved, _ = anchor_step(*t, 0, 0.5, sigma * (1 - 1e-6), pairing)
    assert float((moved - t[2]).abs().max()) > 1e-3


def test_anchor_step_points_the_direction_along_the_summed_residuals():
    """The singular vector's sign is arbitrary; the step is oriented so that it goes along Σ e (towards θ*)."""
    x, y, theta, basis = anchor_problem(200, seed=2)
    new, _ = anchor_step(*(torch.tensor(v) for v in (x, y, theta, basis)), 0, 0.5, 0.0, "all")
    e_sum = ((y - x @ theta)[:, None] * x).sum(0)
    assert float((new.numpy() - theta) @ e_sum) > 0


@pytest.mark.parametrize("k, anchors", [(1, 1), (2, 5), (3, 10), (5, 25), (10, 70)])
def test_default_number_of_anchors_is_ceil_3k_ln_k(k, anchors):
    assert default_num_anchors(k) == anchors == (1 if k == 1 else math.ceil(3 * k * math.log(k)))


@pytest.mark.parametrize(
    "subspace, orth_iters, kinds",
    [
        ("svd", 10, ["register", "subspace", "anchor", "subspace", "anchor", "fedx", "fedx"]),
        ("orthogonal", 2, ["register", "subspace", "subspace", "anchor", "subspace", "subspace", "anchor", "fedx"]),
    ],
)
def test_fedmd_round_schedule(subspace, orth_iters, kinds):
    algo = FedMD(phase1_iters=2, subspace=subspace, orth_iters=orth_iters)
    assert algo.warmup_rounds == kinds.index("fedx")
    got = [algo.phase(r) for r in range(len(kinds))]
    assert [g[0] for g in got] == kinds
    per = 2 if subspace == "svd" else orth_iters + 1
    for r in range(1, algo.warmup_rounds):
        assert got[r][1:] == ((r - 1) // per, (r - 1) % per)
    assert got[0][1:] == (0, 0) and got[-1][1:] == (0, 0)


@pytest.mark.parametrize("epsilon, delta, threshold", [(0.5, 4.0, 2.0), (0.5, None, 0.0), (0.0, 3.0, 0.0)])
def test_fedmd_threshold_is_epsilon_delta(epsilon, delta, threshold):
    assert FedMD(epsilon=epsilon, delta=delta).threshold == threshold


def test_fedmd_defaults():
    algo = FedMD()
    assert algo.num_anchors is None and algo.phase1_iters == 5 and algo.subspace == "svd"
    assert (algo.orth_iters, algo.power_iters, algo.step_scale, algo.epsilon, algo.delta) == (10, 0, 0.5, 0.0, None)
    assert (algo.anchor_min_samples, algo.pairing, algo.seed) == (20, "all", 0)
    assert (algo.local_steps, algo.lr, algo.solver) == (5, 0.05, "gd")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(subspace="power"), r"^FedMD: subspace must be 'svd' or 'orthogonal', got 'power'$"),
        (dict(subspace="orthogonal", orth_iters=0), r"^FedMD: orth_iters must be even and ≥ 2 \(Algorithm 3\), got 0$"),
        (dict(subspace="orthogonal", orth_iters=5), r"^FedMD: orth_iters must be even and ≥ 2 \(Algorithm 3\), got 5$"),
        (dict(phase1_iters=0), r"^FedMD: phase1_iters must be ≥ 1, got 0$"),
        (dict(pairing="some"), r"^FedMD: pairing must be 'all' or 'disjoint', got 'some'$"),
    ],
)
def test_fedmd_configuration_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        FedMD(**kwargs)


def test_fedmd_accepts_the_smallest_valid_settings():
    algo = FedMD(subspace="orthogonal", orth_iters=2, phase1_iters=1, pairing="disjoint")
    assert (algo.sub_rounds, algo.warmup_rounds) == (3, 4)


def context(net, c: int, n: int, rnd: int) -> ClientContext:
    g = torch.Generator().manual_seed(c)
    x, y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return client_context(
        net, x, y, client=c, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, c), round_idx=rnd,
    )


def test_fedmd_registration_draws_anchors_among_the_eligible_clients():
    sizes = [3, 6, 5, 6, 2, 9, 6]  # eligible (≥ 6 samples): clients 1, 3, 5, 6
    net = ClusteredLinear(2, 4, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedMD(num_anchors=3, anchor_min_samples=6, seed=4)
    algo.setup(glob, len(sizes))
    assert algo.h == 3 and algo.anchor_models.shape == (3, 4)
    assert_close_finite(algo.anchor_models, glob["theta"][0].expand(3, 4), rtol=0, atol=0)
    extra = algo.extra_uploads(glob)
    assert extra["eligible"].shape == (7,) and extra["moment"].shape == (3, 4, 4)
    assert extra["anchor_sum"].shape == (3, 4) and extra["anchor_mask"].shape == (3,)
    assert all(v.dtype == torch.float64 for v in extra.values())
    uploads = [algo.client_update(context(net, c, n, 0), glob, {}).upload for c, n in enumerate(sizes)]
    for c, up in enumerate(uploads):
        assert up["eligible"].dtype == torch.float64
        want = np.zeros(7)
        want[c] = float(sizes[c] >= 6)
        assert_close_finite(up["eligible"], want, rtol=0, atol=0)
    averaged = {n: sum(u[n] for u in uploads) / len(uploads) for n in uploads[0]}
    algo.server_update(glob, averaged, RoundFacts(0, num_aggregated=len(uploads)))
    eligible = np.array([1, 3, 5, 6])
    perm = torch.randperm(4, generator=make_generator(4, "fedmd-anchors")).numpy()
    assert algo.anchor_ids.tolist() == sorted(eligible[perm[:3]].tolist())


def test_fedmd_registration_fails_with_too_few_eligible_clients():
    net = ClusteredLinear(2, 4, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedMD(num_anchors=3, anchor_min_samples=6)
    algo.setup(glob, 4)
    eligible = torch.tensor([0.0, 0.25, 0.25, 0.0], dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"^FedMD: only 2 clients have ≥ 6 samples, 3 anchors needed$"):
        algo.server_update(glob, {"eligible": eligible}, RoundFacts(0, num_aggregated=1))


def test_fedmd_setup_refuses_more_anchors_than_clients():
    glob = {"theta": torch.zeros(2, 4, dtype=torch.float64)}
    FedMD(num_anchors=4).setup(glob, 4)
    with pytest.raises(ConfigError, match=r"^FedMD: num_anchors=5 is more than the 4 clients$"):
        FedMD(num_anchors=5).setup(glob, 4)
    with pytest.raises(ConfigError, match=r"^FedMD: num_anchors=5 is more than the 3 clients$"):
        FedMD().setup(glob, 3)  # k = 2: ⌈6 ln 2⌉ = 5 anchors by default


def test_fedmd_orthogonal_iteration_uploads_d_by_k_products():
    glob = {"theta": torch.zeros(2, 4, dtype=torch.float64)}
    algo = FedMD(num_anchors=3, subspace="orthogonal", orth_iters=2)
    algo.setup(glob, 5)
    extra = algo.extra_uploads(glob)
    assert extra["moment"].shape == (3, 4, 2) and extra["moment"].dtype == torch.float64


def test_fedmd_random_start_is_a_seeded_orthonormal_draw_per_iteration():
    """Q₀ of Algorithm 3: QR of an N(0, 1) [H, d, k] draw from the generator of (seed, "fedmd-q0", t)."""
    glob = {"theta": torch.zeros(2, 5, dtype=torch.float64)}
    algo = FedMD(num_anchors=3, subspace="orthogonal", orth_iters=2, seed=6)
    algo.setup(glob, 4)
    for t in (0, 1):
        q = algo.random_start(t, 5, torch.float64)
        draw = torch.randn(3, 5, 2, generator=make_generator(6, "fedmd-q0", t), dtype=torch.float64).numpy()
        ref = np.stack([np.linalg.qr(m)[0] for m in draw])
        assert q.shape == (3, 5, 2)
        # QR is unique up to the sign of each column: compare the projections Q Qᵀ
        assert_close_finite(q @ q.transpose(1, 2), ref @ ref.transpose(0, 2, 1), rtol=1e-10, atol=1e-12)
        assert_close_finite(q.transpose(1, 2) @ q, np.broadcast_to(np.eye(2), (3, 2, 2)), rtol=0, atol=1e-12)
    assert float((algo.random_start(0, 5, torch.float64) - algo.random_start(1, 5, torch.float64)).abs().max()) > 0.1


@pytest.mark.parametrize("model_dtype, data_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64)])
@pytest.mark.parametrize("pairing", ["all", "disjoint"])
def test_fedmd_subspace_round_uploads_the_pair_moment_share_in_the_models_dtype(pairing, model_dtype, data_dtype):
    """Round 1 (svd subspace): a client uploads Σ_{a≠b} e_a e_bᵀ / n for every anchor model, e = (y − xᵀθ)x; data
    in another dtype than the model's are cast to the model's first."""
    net = ClusteredLinear(2, 4, seed=1).to(model_dtype)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedMD(num_anchors=2, anchor_min_samples=1, pairing=pairing)
    algo.setup(glob, 3)
    rng = np.random.default_rng(5)
    x32 = torch.tensor(rng.normal(size=(6, 4)), dtype=data_dtype)
    y32 = torch.tensor(rng.normal(size=6), dtype=data_dtype)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    ctx = client_context(
        net, x32, y32, client=1, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, 1), round_idx=1,
    )
    up = algo.client_update(ctx, glob, {})
    x, y = x32.to(model_dtype).double().numpy(), y32.to(model_dtype).double().numpy()
    theta = glob["theta"][0].double().numpy()
    e = (y - x @ theta)[:, None] * x
    share = np_pair_matrix(e, pairing) / 6
    assert up.upload["moment"].dtype == model_dtype
    tol = dict(rtol=1e-10, atol=1e-12) if model_dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    assert_close_finite(up.upload["moment"], np.stack([share, share]), **tol)


def np_pair_matrix(e: np.ndarray, pairing: str) -> np.ndarray:
    """Y = Σ a bᵀ over the pairs: all ordered a ≠ b, or the disjoint (2j, 2j+1)."""
    if pairing == "disjoint":
        return sum(np.outer(e[2 * j], e[2 * j + 1]) for j in range(len(e) // 2))
    return sum(np.outer(e[a], e[b]) for a in range(len(e)) for b in range(len(e)) if a != b)


def qr_q(m: np.ndarray) -> np.ndarray:
    return torch.linalg.qr(torch.tensor(m))[0].numpy()


@pytest.mark.parametrize("pairing", ["all", "disjoint"])
def test_fedmd_orthogonal_phase1_round_by_round(pairing):
    """One Phase-1 iteration with Algorithm 3 (orth_iters = 4) driven by hand: registration, YᵀQ₀ (Q₀ the seeded
    random start), Q₁ = QR of Y·(YᵀQ₀), YᵀQ₁, QR of Y·(YᵀQ₁), the anchors' steps (2 power iterations, step scale
    0.6) and the grouping, every upload and server state against numpy (Y over the chosen pairs; QR by
    torch.linalg.qr)."""
    sizes, d = [6, 7, 5], 4
    rng = np.random.default_rng(9)
    data = [(rng.normal(size=(n, d)), rng.normal(size=n)) for n in sizes]
    net = ClusteredLinear(2, d, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedMD(num_anchors=2, phase1_iters=1, subspace="orthogonal", orth_iters=4, power_iters=2, step_scale=0.6,
                 anchor_min_samples=6, pairing=pairing, seed=3)  # fmt: skip
    algo.setup(glob, 3)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    total = sum(sizes)

    def round_(rnd: int) -> list[dict]:
        ups = []
        for c, (x, y) in enumerate(data):
            ctx = client_context(
                net, torch.tensor(x), torch.tensor(y), client=c, optimizer=opt, loss=F.mse_loss,
                generator=make_generator(0, c), round_idx=rnd,
            )
            up = algo.client_update(ctx, glob, {})
            assert up.num_samples == sizes[c] and up.loss == 0.0  # Phase 1 trains nothing: no loss to report
            ups.append(up.upload)
        averaged = {n: sum(u[n] * m for u, m in zip(ups, sizes)) / total for n in ups[0]}
        algo.server_update(glob, averaged, RoundFacts(rnd, num_aggregated=len(ups)))
        return ups

    round_(0)
    assert algo.anchor_ids.tolist() == [0, 1]  # the only clients with ≥ 6 points
    theta0 = glob["theta"][0].numpy().copy()
    e = [(y - x @ theta0)[:, None] * x for x, y in data]
    ys = [np_pair_matrix(ei, pairing) for ei in e]
    q0 = qr_q(torch.randn(2, d, 2, generator=make_generator(3, "fedmd-q0", 0), dtype=torch.float64).numpy())

    q = q0
    for sub in range(4):  # Algorithm 3: even sub-rounds Σ_i Y_iᵀ Q (step 5, kept as is), odd Σ_i Y_i Q then QR
        ups = round_(1 + sub)
        mats = [yc.T if sub % 2 == 0 else yc for yc in ys]
        for c in range(3):
            want = np.stack([mats[c] @ q[h] for h in range(2)]) / sizes[c]
            assert_close_finite(ups[c]["moment"], want, rtol=1e-9, atol=1e-12, msg=f"sub-round {sub}, client {c}")
        agg = np.stack([sum(mats) @ q[h] for h in range(2)]) / total
        q = agg if sub % 2 == 0 else qr_q(agg)
        assert_close_finite(algo.basis, q, rtol=1e-9, atol=1e-12, msg=f"sub-round {sub}")
    basis = q

    ups = round_(5)  # the anchors' steps
    models = np.stack(
        [np_anchor_step(*data[h], theta0, basis[h], 2, 0.6, 0.0, pairing)[0] for h in range(2)]
    )
    for c in range(3):
        mask = np.zeros(2)
        if c < 2:
            mask[c] = 1.0
        assert ups[c]["anchor_mask"].dtype == ups[c]["anchor_sum"].dtype == torch.float64
        assert_close_finite(ups[c]["anchor_mask"], mask, rtol=0, atol=0)
        assert_close_finite(ups[c]["anchor_sum"], models * mask[:, None], rtol=1e-10, atol=1e-12)
    assert_close_finite(algo.anchor_models, models, rtol=1e-10, atol=1e-12)
    assert sorted(algo.anchor_labels.tolist()) == [0, 1]  # two anchors, k = 2: one group each
    assert algo.anchor_labels.dtype == algo.anchor_ids.dtype == torch.long
    assert_close_finite(glob["theta"], models[algo.anchor_labels.argsort().numpy()], rtol=1e-10, atol=1e-12)
    assert float(np.abs(models - theta0).max()) > 1e-2


LINE = np.array([[0.0, 0.0], [10.0, 0.0], [3.0, 0.0]])  # three anchors on a line, 3 and 7 apart


@pytest.mark.parametrize(
    "delta, groups_at_half_delta",
    [(2.5, [[0], [1], [2]]), (7.0, [[0, 2], [1]])],  # Δ/2 = 1.25: every anchor alone; Δ/2 = 3.5: 0 and 3 join
)
def test_group_anchors_numbers_groups_as_the_single_linkage_cut(delta, groups_at_half_delta):
    """k = 3. With Δ = 2.5 the Δ/2 rule gives 3 groups: labels as scipy numbers the cut at distance Δ/2 (not the
    order of the anchors). With Δ = 7 it gives 2 groups, so single linkage is cut at k = 3 groups instead."""
    # the grouping at Δ/2, by hand: connected components of "closer than Δ/2"
    close = np.linalg.norm(LINE[:, None] - LINE[None], axis=-1) <= delta / 2
    comp = list(range(3))
    for a in range(3):
        for b in range(3):
            if close[a, b]:
                old, new = comp[b], comp[a]
                comp = [new if c == old else c for c in comp]
    by_hand = sorted(sorted(i for i in range(3) if comp[i] == c) for c in set(comp))
    assert by_hand == groups_at_half_delta
    tree = linkage(LINE, method="single")
    if len(by_hand) == 3:
        want = fcluster(tree, t=delta / 2, criterion="distance") - 1
    else:
        want = fcluster(tree, t=3, criterion="maxclust") - 1
    labels, centres = group_anchors(torch.tensor(LINE), 3, delta)
    assert labels.tolist() == want.tolist() and labels.dtype == torch.long
    assert_close_finite(centres[labels], LINE, rtol=0, atol=0)  # one anchor per group: the centre is the anchor
    if delta == 2.5:
        assert labels.tolist() != [0, 1, 2]  # this cut's numbering differs from the anchors' order


def test_group_anchors_with_one_anchor():
    labels, centres = group_anchors(torch.tensor([[1.5, -2.0]], dtype=torch.float64), 1, 0.5)
    assert labels.tolist() == [0] and labels.dtype == torch.long
    assert_close_finite(centres, [[1.5, -2.0]], rtol=0, atol=0)


def test_fedmd_passes_the_fedx_settings_to_ifca():
    algo = FedMD(local_steps=3, lr=0.2, solver="prox")
    assert (algo.local_steps, algo.lr, algo.solver) == (3, 0.2, "prox")


def test_group_anchors_fills_an_empty_group_with_an_anchor():
    """Anchors that never moved coincide: single linkage cannot split them into k = 2 groups; the empty group's
    centre is anchor j mod H (here every anchor is the same point), never the mean of nothing."""
    models = torch.tensor([[1.0, -1.0]] * 3, dtype=torch.float64)
    labels, centres = group_anchors(models, 2)
    assert labels.tolist() == [0, 0, 0]
    assert_close_finite(centres, [[1.0, -1.0], [1.0, -1.0]], rtol=0, atol=0)


def test_anchor_step_defaults_are_exact_svd_half_step_no_threshold_all_pairs():
    x, y, theta, basis = anchor_problem(8, seed=3)
    y, theta = 0.02 * y, 0.02 * theta  # small residuals: σ̂ < 1
    new, sigma = anchor_step(*(torch.tensor(v) for v in (x, y, theta, basis)))
    ref, ref_sigma = np_anchor_step(x, y, theta, basis, 0, 0.5, 0.0, "all")
    assert 0.01 < ref_sigma < 1 and sigma == pytest.approx(ref_sigma, rel=1e-10)
    assert_close_finite(new, ref, rtol=1e-10, atol=1e-12)


def test_anchor_step_keeps_the_power_iterations_sign_when_the_residuals_sum_to_zero():
    """θ = 0, two copies of a point with opposite labels: e₂ = −e₁, so Σe = 0 exactly while A = −p₁p₁ᵀ ≠ 0.
    Nothing to orient by: the step keeps the power iteration's β̂ (started from the positive vector 1/√k)."""
    rng = np.random.default_rng(6)
    x1 = rng.normal(size=5)
    x, y = np.stack([x1, x1]), np.array([1.3, -1.3])
    theta, basis = np.zeros(5), np.linalg.qr(rng.normal(size=(5, 3)))[0]
    new, sigma = anchor_step(*(torch.tensor(v) for v in (x, y, theta, basis)), 3, 0.5, 0.0, "all")
    ref, ref_sigma = np_anchor_step(x, y, theta, basis, 3, 0.5, 0.0, "all")
    assert ref_sigma > 0.1 and sigma == pytest.approx(ref_sigma, rel=1e-10)
    assert_close_finite(new, ref, rtol=1e-10, atol=1e-12)
