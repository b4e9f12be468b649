"""``experiments/linear_representation/fedavg_linear.py`` (spec 004): FedAvg vs D-GD in batched tensor math against
small numpy loops, the distance and gradient norm, the papers' claims at CI size, Proposition 2's construction, and the
engine's LinearFedAvg against the batched path."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from experiments.linear_representation import fedavg_linear as fa
from fl_lightning.algorithms import LinearFedAvg
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import LinearRepresentation
from tests.helpers.asserts import assert_close_finite
from tests.helpers.linear_tasks import F64, engine_data, gen, np_dist
from tests.helpers.training import fit


def np_fedavg(b, w, sigmas, cs, alpha, tau, rounds):
    """Reference: one trial, a Python loop over clients and steps, simultaneous updates, average of both."""
    for _ in range(rounds):
        bs, ws = [], []
        for sigma, c in zip(sigmas, cs):
            bi, wi = b.copy(), w.copy()
            for _ in range(tau):
                e = sigma @ (bi @ wi) - c
                bi, wi = bi - alpha * np.outer(e, wi), wi - alpha * bi.T @ e
            bs.append(bi)
            ws.append(wi)
        b, w = np.mean(bs, 0), np.mean(ws, 0)
    return b, w


def np_global_loss(b, w, sigmas, cs):
    """mean_i ½θᵀΣᵢθ − cᵢᵀθ with θ = Bw (the global objective up to a constant)."""
    theta = b @ w
    return np.mean([0.5 * theta @ s @ theta - c @ theta for s, c in zip(sigmas, cs)])


@pytest.mark.parametrize("finite", [False, True])
def test_fedavg_matches_numpy_loop(finite):
    g = gen(0)
    b_star, w_star = fa.spec004_ground_truth(2, 3, 5, 2, g)
    b0 = torch.randn(2, 5, 2, generator=g, dtype=F64)
    w0 = torch.randn(2, 2, generator=g, dtype=F64)
    if finite:
        x = torch.randn(2, 3, 7, 5, generator=g, dtype=F64)
        y = torch.einsum("tmnd,tmd->tmn", x, torch.einsum("tdk,tmk->tmd", b_star, w_star)) + 0.1
        obj = fa.sample_objectives(x, y)
    else:
        obj = fa.population_objectives(b_star, w_star)
    step = 0.1  # at 0.3 the finite-sample reference overflows to NaN (issue 20); at 0.1 it converges
    run = fa.fedavg(b0, w0, obj, step, 3, 4)
    for t in range(2):
        if finite:
            xs, ys = x[t].numpy(), y[t].numpy()
            sigmas = [xi.T @ xi / 7 for xi in xs]
            cs = [xi.T @ yi / 7 for xi, yi in zip(xs, ys)]
        else:
            sigmas = [np.eye(5)] * 3
            cs = [b_star[t].numpy() @ wi for wi in w_star[t].numpy()]
        refs = [np_fedavg(b0[t].numpy(), w0[t].numpy(), sigmas, cs, step, 3, r) for r in range(5)]
        losses = [np_global_loss(b, w, sigmas, cs) for b, w in refs]
        assert all(a > b for a, b in zip(losses, losses[1:])), losses  # the reference converges at this step
        b_ref, w_ref = refs[4]
        assert_close_finite(run.b[t], b_ref, rtol=1e-7, atol=1e-12)
        assert_close_finite(run.w[t], w_ref, rtol=1e-7, atol=1e-12)


def test_distance_and_gradient_norm_match_references():
    g = gen(1)
    b_star, w_star = fa.spec004_ground_truth(3, 4, 6, 2, g)
    b, w = torch.randn(3, 6, 2, generator=g, dtype=F64), torch.randn(3, 2, generator=g, dtype=F64)
    dist = fa.distance(b_star, b)
    for t in range(3):
        assert abs(float(dist[t]) - np_dist(b_star[t].numpy(), b[t].numpy())) < 1e-12
        bb, ww = b[t].clone().requires_grad_(), w[t].clone().requires_grad_()
        loss = 0.5 * ((bb @ ww)[None] - (b_star[t] @ w_star[t].T).T).square().sum(-1).mean()
        gb, gw = torch.autograd.grad(loss, (bb, ww))
        expected = (gb.square().sum() + gw.square().sum()).sqrt()
        assert abs(float(fa.global_gradient_norm(b, w, b_star, w_star)[t]) - float(expected)) < 1e-12


def test_spec004_init_and_finetune_reference():
    b0, w0 = fa.spec004_init(2, 6, 3, 0.4, gen(2))
    eye = torch.eye(3, dtype=F64)
    assert_close_finite(0.4 * b0.transpose(1, 2) @ b0, eye.expand(2, 3, 3), rtol=1e-5, atol=1e-8)
    assert not w0.any()
    g = gen(3)
    b, w = torch.randn(2, 6, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    x, y = torch.randn(2, 9, 6, generator=g, dtype=F64), torch.randn(2, 9, generator=g, dtype=F64)
    for head_only in (False, True):
        bf, wf = fa.finetune(b, w, x, y, steps=25, lr=0.05, head_only=head_only)
        for t in range(2):
            bb, ww, xx, yy = b[t].numpy().copy(), w[t].numpy().copy(), x[t].numpy(), y[t].numpy()
            for _ in range(25):
                r = xx @ (bb @ ww) - yy
                gb, gw = np.outer(xx.T @ r / 9, ww), bb.T @ (xx.T @ r / 9)
                bb, ww = (bb if head_only else bb - 0.05 * gb), ww - 0.05 * gw
            assert_close_finite(bf[t].numpy(), bb, rtol=1e-7, atol=1e-12)
            assert_close_finite(wf[t].numpy(), ww, rtol=1e-7, atol=1e-12)


@pytest.fixture(scope="module")
def spec004_runs():
    """Spec 004 §4.1 at CI size: d=10, k=2, M=m=20, α=0.4, B₀ = Q/√α, w₀ = 0, population gradients, 3 trials."""
    g = gen(0)
    b_star, w_star = fa.spec004_ground_truth(3, 20, 10, 2, g)
    b0, w0 = fa.spec004_init(3, 10, 2, 0.4, g)
    obj = fa.population_objectives(b_star, w_star)
    runs = {tau: fa.fedavg(b0, w0, obj, 0.4, tau, 400, b_star=b_star, w_star=w_star) for tau in (1, 2)}
    return b_star, w_star, runs


def test_fedavg_learns_representation_dgd_does_not(spec004_runs):
    _, _, runs = spec004_runs
    fedavg, dgd = runs[2], runs[1]
    assert float(fedavg.dist[-1].max()) < 1e-6
    assert float(dgd.dist[-1].min()) > 0.5
    # Remark 2: FedAvg reaches B* without reaching a stationary point of the global objective; D-GD heads there.
    g_fedavg, g_dgd = fedavg.grad_norm, dgd.grad_norm
    assert float(g_fedavg[-1].min()) > 1e-2
    assert_close_finite(g_fedavg[-1], g_fedavg[-100], rtol=1e-6, atol=1e-8)
    assert float(g_dgd[-1].median()) < 0.2 * float(g_fedavg[-1].median())


def test_fedavg_trained_models_finetune_better(spec004_runs):
    b_star, _, runs = spec004_runs
    err = {tau: fa.finetune_new_client(runs[tau].b, runs[tau].w, b_star, 20, gen(7)) for tau in (1, 2)}
    assert float(err[2].mean()) < 0.1 * float(err[1].mean())
    assert float(err[2].max()) < 0.02


def test_larger_tau_and_alpha_converge_faster():
    """Per trial, the fitted slope of log dist over the linear phase gets steeper with τ (α=0.4) and with α (τ=2)."""
    g = gen(4)
    b_star, w_star = fa.spec004_ground_truth(3, 20, 20, 3, g)
    obj = fa.population_objectives(b_star, w_star)
    slopes = {}
    for tau in (2, 3, 5):
        run = fa.fedavg(*fa.spec004_init(3, 20, 3, 0.4, gen(5)), obj, 0.4, tau, 300, b_star=b_star)
        slopes[("tau", tau)] = [fa.log_slope(run.dist[:, t]) for t in range(3)]
    for alpha in (0.2, 0.3, 0.4):
        run = fa.fedavg(*fa.spec004_init(3, 20, 3, alpha, gen(5)), obj, alpha, 2, 600, b_star=b_star)
        slopes[("alpha", alpha)] = [fa.log_slope(run.dist[:, t]) for t in range(3)]
    for t in range(3):
        assert slopes[("tau", 2)][t] > slopes[("tau", 3)][t] > slopes[("tau", 5)][t]
        assert slopes[("alpha", 0.2)][t] > slopes[("alpha", 0.3)][t] > slopes[("alpha", 0.4)][t]


def test_log_slope_recovers_geometric_rate():
    values = 0.5 * 0.9 ** torch.arange(200, dtype=F64)
    assert abs(fa.log_slope(values) - np.log10(0.9)) < 1e-12


def test_partial_participation_still_learns():
    """Spec 004 Fig. 6's setting in small: m=5 of M=20 clients per round."""
    g = gen(6)
    b_star, w_star = fa.spec004_ground_truth(3, 20, 10, 2, g)
    run = fa.fedavg(
        *fa.spec004_init(3, 10, 2, 0.4, g), fa.population_objectives(b_star, w_star), 0.4, 2, 400, 5, gen(8), b_star
    )
    assert float(run.dist[-1].max()) < 1e-4


def test_proposition2_construction():
    """Two ground truths with the same B*w̄*: identical D-GD iterates, and one of them stays ≥ 0.7δ₀ away."""
    g = gen(9)
    d, k, alpha, delta0 = 10, 3, 0.4, 0.3
    heads = torch.randn(20, k, generator=g, dtype=F64)
    b0, w0 = fa.spec004_init(1, d, k, alpha, g)
    b_a, b_b = fa.dgd_indistinguishable_truths(b0[0], heads, delta0)
    for b in (b_a, b_b):
        assert_close_finite(b.T @ b, torch.eye(k, dtype=F64), rtol=1e-5, atol=1e-12)
        assert abs(np_dist(b.numpy(), b0[0].numpy()) - delta0) < 1e-12
    assert_close_finite(b_a @ heads.mean(0), b_b @ heads.mean(0), rtol=1e-5, atol=1e-12)
    assert np_dist(b_a.numpy(), b_b.numpy()) >= 2 * delta0 * np.sqrt(1 - delta0**2) - 1e-12
    truths = torch.stack([b_a, b_b])
    obj = fa.population_objectives(truths, heads.expand(2, -1, -1))
    dgd = fa.fedavg(b0.expand(2, -1, -1), w0.expand(2, -1), obj, alpha, 1, 300, b_star=truths)
    assert_close_finite(dgd.b[0], dgd.b[1], rtol=1e-5, atol=1e-12)
    assert_close_finite(dgd.w[0], dgd.w[1], rtol=1e-5, atol=1e-12)
    assert float(dgd.dist[-1].max()) >= 0.7 * delta0
    fedavg = fa.fedavg(b0.expand(2, -1, -1), w0.expand(2, -1), obj, alpha, 2, 300, b_star=truths)
    assert float(fedavg.dist[-1].max()) < 1e-6  # local steps see the heads' diversity and tell them apart


def test_engine_linear_fedavg_matches_batched_path():
    n, d, k, m = 8, 6, 2, 30
    dm, fed, x, y = engine_data(n, d, k, m)
    for tau in (1, 2):
        L.seed_everything(3)
        net = LinearRepresentation(d, k)
        q = torch.linalg.qr(net.body.weight.detach().T.double()).Q
        module = FederatedModule(LinearFedAvg(tau, 0.4), net, aggregation="uniform", eval_every=5, eval_last=1)
        fit(module, dm, rounds=12)
        b_star = fed.extras["B_star"].double()
        obj = fa.sample_objectives(x, y)
        run = fa.fedavg(q[None] / 0.4**0.5, torch.zeros(1, k, dtype=F64), obj, 0.4, tau, 12, b_star=b_star[None])
        assert float(run.dist[0, 0]) > 0.3
        assert_close_finite(run.b[0], net.body.weight.detach().T.double(), rtol=1e-5, atol=1e-5)
        assert_close_finite(run.w[0], net.head.weight.detach()[0].double(), rtol=1e-5, atol=1e-5)
        assert abs(module.history[-1]["val/dist_B"] - float(fa.distance(b_star[None], run.b)[0])) < 1e-5
