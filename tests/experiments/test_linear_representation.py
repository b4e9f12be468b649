"""Representation learning in the two-layer linear setting (specs 004 and 000): the batched math against small
numpy references, the papers' claims at CI size, the engine path against the batched path, and the CIFAR
transfer pieces on tiny fixture files."""

from __future__ import annotations

import json
import pickle

import lightning as L
import numpy as np
import pytest
import torch

from datamodules import SyntheticLinearDataModule
from experiments.linear_representation import fedavg_linear as fa
from experiments.linear_representation import fedrep_linear as fr
from experiments.linear_representation.features import class_feature_cosine, mean_offdiagonal
from experiments.linear_representation.transfer import balanced_subset
from fl_lightning.algorithms import FedAvgSteps, LinearFedAvg, LinearFedRep
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import LinearRepresentation, TransferCNN
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import fit

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def np_dist(b_star: np.ndarray, b: np.ndarray) -> float:
    q = np.linalg.qr(b)[0]
    return float(np.linalg.svd((np.eye(len(b)) - b_star @ b_star.T) @ q, compute_uv=False)[0])


# ---- spec 004: FedAvg vs D-GD ------------------------------------------------------------------------------
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


# ---- spec 000: FedRep's synthetic experiments --------------------------------------------------------------
def test_fedrep_rounds_match_numpy_loop():
    g = gen(10)
    tasks = fr.make_tasks(2, 4, 6, 5, 2, 1e-3, g)
    b0 = fr.random_init(2, 5, 2, g)
    w0 = torch.randn(2, 4, 2, generator=g, dtype=F64)
    for head_steps in (None, 3):
        run = fr.fedrep(tasks, b0, w0, 3, body_lr=0.1, head_steps=head_steps, head_lr=0.2)
        for t in range(2):
            b, ws = b0[t].numpy(), w0[t].numpy().copy()
            for _ in range(3):
                bs = []
                for i in range(4):
                    x, y = tasks.x[t, i].numpy(), tasks.y[t, i].numpy()
                    f = x @ b
                    if head_steps is None:
                        ws[i] = np.linalg.lstsq(f, y, rcond=None)[0]
                    else:
                        for _ in range(head_steps):
                            ws[i] = ws[i] - 0.2 * f.T @ (f @ ws[i] - y) / 6
                    bs.append(b - 0.1 * np.outer(x.T @ (f @ ws[i] - y) / 6, ws[i]))
                b = np.linalg.qr(np.mean(bs, 0))[0]
            assert_close_finite(run.b[t].numpy(), b, rtol=1e-7, atol=1e-10)
            assert_close_finite(run.w[t].numpy(), ws, rtol=1e-7, atol=1e-10)
            f_ref = 0.5 * np.mean([np.sum((b @ ws[i] - tasks.theta_star[t, i].numpy()) ** 2) for i in range(4)])
            assert abs(float(run.fvalue[-1, t]) - f_ref) < 1e-10


def test_init_estimators_match_references_and_improve_with_data():
    g = gen(11)
    tasks = fr.make_tasks(1, 6, 4, 5, 2, 1e-3, g)
    x, y = tasks.x[0].reshape(-1, 5).numpy(), tasks.y[0].reshape(-1).numpy()
    z = (x * y[:, None] ** 2).T @ x / len(y)
    top = np.linalg.eigh(z)[1][:, -2:]
    assert np_dist(top, fr.method_of_moments_init(tasks.x, tasks.y, 2)[0].numpy()) < 1e-10
    med = {}
    for n, m in ((20, 5), (1000, 20)):
        t = fr.make_tasks(5, n, m, 10, 2, 1e-3, gen(12))
        med[n] = (
            float(fa.distance(t.b_star, fr.method_of_moments_init(t.x, t.y, 2)).median()),
            float(fa.distance(t.b_star, fr.projected_gd_init(t.x, t.y, 2)[0]).median()),
        )
    assert med[1000][0] < 0.5 * med[20][0] and med[1000][1] < 0.5 * med[20][1]


def test_fedrep_fig3_claims():
    """d=10, k=2, m=5, r=0.1, random init, 120 rounds: larger n is faster; FedRep < 10GD-GD < GD-GD for n ≥ 100."""
    final = {}
    for n in (10, 100, 1000):
        tasks = fr.make_tasks(4, n, 5, 10, 2, 1e-3, gen(13))
        b0 = fr.random_init(4, 10, 2, gen(14))
        w0 = torch.zeros(4, 1, 2, dtype=F64)
        for name, steps in (("FedRep", None), ("10GD-GD", 10), ("GD-GD", 1)):
            run = fr.fedrep(tasks, b0, w0, 120, 0.1, steps, 0.1, clients_per_round=n // 10, generator=gen(15))
            final[name, n] = float(run.dist[-1].median())
    assert final["FedRep", 10] > final["FedRep", 100] > final["FedRep", 1000]
    assert final["10GD-GD", 10] > final["10GD-GD", 100] > final["10GD-GD", 1000]
    for n in (100, 1000):
        assert final["FedRep", n] < final["10GD-GD", n] < final["GD-GD", n]


def test_fedrep_fig7_gap_grows_with_n():
    """Fig. 7 (r=1, projected-GD init): GD-GD's F over FedRep's F after 10 rounds grows with n."""
    ratio = {}
    for n in (10, 1000):
        tasks = fr.make_tasks(4, n, 10, 10, 2, 1e-3, gen(21))
        b0, w0 = fr.projected_gd_init(tasks.x, tasks.y, 2)
        f = {steps: fr.fedrep(tasks, b0, w0, 10, 0.1, steps, 0.1).fvalue[-1].mean() for steps in (None, 1)}
        ratio[n] = float(f[1] / f[None])
    assert 1 < ratio[10] < ratio[1000] / 10


def test_new_client_and_training_error_claims():
    """Fig. 1 / Fig. 4 at CI size: n=100, d=20, k=2, m=10, r=1."""
    trials, n, d, k, m = 3, 100, 20, 2, 10
    tasks = fr.make_tasks(trials, n, m, d, k, 1e-3, gen(16))
    b0 = fr.random_init(trials, d, k, gen(17))
    rep = fr.fedrep(tasks, b0, torch.zeros(trials, 1, k, dtype=F64), 150, 0.1)
    sgd = fa.fedavg(b0, torch.zeros(trials, k, dtype=F64), fa.sample_objectives(tasks.x, tasks.y), 0.1, 1, 150)
    signal = float(tasks.theta_star.square().sum(-1).mean())  # = k
    train = {
        "FedRep": fr.squared_error(torch.einsum("tdk,tnk->tnd", rep.b, rep.w), tasks.theta_star).mean(),
        "FedSGD": fr.squared_error(torch.einsum("tdk,tk->td", sgd.b, sgd.w)[:, None], tasks.theta_star).mean(),
        "Local Only": fr.squared_error(fr.local_only(tasks.x, tasks.y), tasks.theta_star).mean(),
    }
    assert train["FedRep"] < 0.01 * signal and train["FedSGD"] > 0.5 * signal and train["Local Only"] > 0.3 * signal
    med = {}  # median over new clients and trials: with m_new = k the 2×2 solves have a heavy-tailed mean
    for m_new in (1, 2, 5, 10, 40):
        x, y, theta = fr.new_clients(tasks.b_star, m_new, 50, 1e-3, gen(18))
        med["FedRep", m_new] = float(fr.head_on_representation_error(rep.b, x, y, theta).median())
        med["FedSGD", m_new] = float(fr.head_on_representation_error(sgd.b, x, y, theta).median())
        med["Local Only", m_new] = float(fr.squared_error(fr.local_only(x, y), theta).median())
    assert med["FedRep", 1] > 0.1 * signal and med["FedRep", k] < 0.01 * signal  # drops once m_new ≥ k
    assert med["Local Only", 10] > 0.3 * signal and med["Local Only", 40] < 0.01 * signal  # needs about d
    assert min(med["FedSGD", mn] for mn in (1, 2, 5, 10, 40)) > 0.5 * signal  # stays high


# ---- the engine path agrees with the batched path -----------------------------------------------------------
def _engine_data(n: int, d: int, k: int, m: int, noise: float = 1e-3, participation: float = 1.0):
    dm = SyntheticLinearDataModule(n, d, k, m, 10, noise, participation=participation, seed=0)
    dm.setup()
    fed = dm.federated
    x, y = fed.train.x.double().reshape(1, n, m, d), fed.train.y.double().reshape(1, n, m)
    return dm, fed, x, y


def test_engine_linear_fedavg_matches_batched_path():
    n, d, k, m = 8, 6, 2, 30
    dm, fed, x, y = _engine_data(n, d, k, m)
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


@pytest.mark.parametrize("head_steps,conventions", [(None, "default"), (10, "default"), (1, "legacy")])
def test_engine_linear_fedrep_matches_batched_path(head_steps, conventions):
    """Half of the clients per round: the batched path replays the engine's cohorts (``ClientSampler``). Default
    conventions: zero heads, positive-diagonal QR; ``legacy``: the network's shared random head, LAPACK's QR signs."""
    n, d, k, m = 8, 6, 2, 5
    dm, fed, x, y = _engine_data(n, d, k, m, participation=0.5)
    L.seed_everything(1)
    net = LinearRepresentation(d, k)
    b0, w0 = net.body.weight.detach().T.double().clone(), net.head.weight.detach()[0].double().clone()
    solver = "exact" if head_steps is None else "gd"
    legacy = conventions == "legacy"
    algorithm = LinearFedRep(
        body_lr=0.1, head_solver=solver, head_steps=head_steps or 1, head_lr=0.1,
        head_init="shared_random" if legacy else "zeros", positive_qr=not legacy,
    )  # fmt: skip
    module = FederatedModule(algorithm, net, aggregation="uniform", eval_every=5, eval_last=1)
    fit(module, dm, rounds=12, seed=1)
    tasks = fr.Tasks(x, y, fed.extras["B_star"].double()[None], fed.extras["W_star"].double()[None])
    cohorts = ClientSampler(n, 4, 0).sample
    w_start = w0[None, None] if legacy else torch.zeros(1, 1, k, dtype=F64)
    run = fr.fedrep(tasks, b0[None], w_start, 12, 0.1, head_steps, 0.1, cohorts=cohorts, positive_qr=not legacy)
    assert_close_finite(run.b[0], net.body.weight.detach().T.double(), rtol=1e-5, atol=1e-5)
    assert abs(module.history[-1]["val/dist_B"] - float(run.dist[-1, 0])) < 1e-5


@pytest.mark.parametrize("tau", [1, 3])
def test_fedavg_steps_takes_exactly_tau_local_steps(tau):
    """One client, full-batch minibatches, no momentum: one round of FedAvgSteps = τ GD steps on ½·mse."""
    dm, fed, x, y = _engine_data(1, 4, 2, 12)
    L.seed_everything(2)
    net = LinearRepresentation(4, 2)
    ref = [p.detach().clone().requires_grad_() for p in (net.body.weight, net.head.weight)]
    module = FederatedModule(FedAvgSteps(tau), net, lr=0.05, momentum=0.0, batch_size=12, eval_last=1)
    fit(module, dm, rounds=1, seed=2)
    xs, ys = fed.train.x.float(), fed.train.y.float()  # the engine casts the float64 data to the network dtype
    for _ in range(tau):
        loss = 0.5 * ((xs @ ref[0].T @ ref[1].T).squeeze(-1) - ys).square().mean()
        grads = torch.autograd.grad(loss, ref)
        ref = [(p - 0.05 * g).detach().requires_grad_() for p, g in zip(ref, grads)]
    assert_close_finite(net.body.weight.detach(), ref[0].detach(), rtol=1e-5, atol=1e-6)
    assert_close_finite(net.head.weight.detach(), ref[1].detach(), rtol=1e-5, atol=1e-6)


def test_linear_configs_run_through_train_py(tmp_path):
    from experiments.representation import CONFIGS
    from fl_lightning.cli import train_config

    overrides = ["--trainer.max_steps=3", "--trainer.enable_checkpointing=false", "--data.init_args.num_clients=4"]
    for pair in (("linear_base", "linear_fedavg"), ("fedrep_base", "gdgd")):
        summary = train_config([CONFIGS / f"{c}.yaml" for c in pair], overrides, run_dir=tmp_path / pair[1])
        assert summary["rounds"] == 3 and 0 <= summary["dist_B"] <= 1


# ---- spec 004 §4.2: the CIFAR transfer pieces -----------------------------------------------------------------
def test_transfer_cnn_and_feature_similarity():
    net = TransferCNN(num_classes=80)
    assert net.features(torch.zeros(2, 3, 32, 32)).shape == (2, 512)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 80)
    assert sum(isinstance(mod, torch.nn.Conv2d) for mod in net.modules()) == 6
    assert [n for n, _ in net.named_parameters() if n.startswith("head.")] == ["head.weight", "head.bias"]
    feats = torch.randn(3, 4, 7, generator=gen(19))
    sim = class_feature_cosine(feats)
    f = feats.numpy()
    for c in range(3):
        for e in range(3):
            ref = np.mean(
                [abs(f[c, i] @ f[e, i]) / np.linalg.norm(f[c, i]) / np.linalg.norm(f[e, i]) for i in range(4)]
            )
            assert abs(float(sim[c, e]) - ref) < 1e-6
    assert abs(mean_offdiagonal(sim) - float(sim[~torch.eye(3, dtype=bool)].mean())) < 1e-7
    idx = balanced_subset(torch.arange(20).repeat_interleave(5), 50, gen(20))
    counts = torch.bincount(torch.arange(20).repeat_interleave(5)[idx], minlength=20)
    assert len(set(idx.tolist())) == 50 and set(counts.tolist()) == {2, 3}


def write_cifar100(root, per_class_train: int = 5, per_class_test: int = 5) -> None:
    """Tiny CIFAR-100 in the published python-pickle format."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, per in (("train", per_class_train), ("test", per_class_test)):
        labels = np.repeat(np.arange(100), per)
        data = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
        data[:, :100] = (labels * 2)[:, None]  # a class-dependent patch so fine-tuning has signal
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "fine_labels": labels.tolist(), "coarse_labels": [0] * len(labels)}, f)
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"class{i}" for i in range(100)]}))


def test_cifar100_transfer_configs_dry_run(tmp_path):
    from experiments.representation import cifar_transfer

    write_cifar100(tmp_path / "data")
    overrides = [
        f"--data.init_args.data_dir={tmp_path / 'data'}",
        "--data.init_args.num_clients=16",
        "--trainer.max_steps=2",
        "--trainer.accelerator=cpu",
        "--model.algorithm.init_args.local_steps=2",
        "--model.eval_last=1",
        "--model.new_client_finetune.epochs=1",
        "--model.network.init_args.channels=[4,4,4,4,4,4]",
        "--model.network.init_args.hidden=16",
    ]
    records = cifar_transfer(tmp_path / "data", tmp_path / "out", overrides, finetune_epochs=1, finetune_samples=50)
    for metric in ("new_client_acc", "engine_new_clients_acc"):
        acc = {r["method"]: r["value"] for r in records if r["metric"] == metric}
        assert set(acc) == {"FedAvg τ=50", "D-SGD τ=1"} and all(0 <= v <= 1 for v in acc.values())
    sims = [r["value"] for r in records if r["metric"] == "feature_abs_cos"]
    assert len(sims) == 2 and all(0 <= v <= 1 for v in sims)


def test_reproduce_quick(tmp_path):
    from experiments.representation import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["experiment"] for r in records} >= {"spec004_fig1", "fedrep_fig3", "fedrep_fig4", "engine_spec004"}
    assert len(list(tmp_path.glob("*.png"))) >= 8
