"""``experiments/linear_representation/fedrep_linear.py`` (spec 000 §3.1, §5): FedRep's synthetic rounds against a
numpy loop, the initial estimators, the figures' claims at CI size, and the engine's LinearFedRep against the batched
path."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from experiments.linear_representation import fedavg_linear as fa
from experiments.linear_representation import fedrep_linear as fr
from fl_lightning.algorithms import LinearFedRep
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import LinearRepresentation
from tests.helpers.asserts import assert_close_finite
from tests.helpers.linear_tasks import F64, engine_data, gen, np_dist
from tests.helpers.training import fit


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


@pytest.mark.parametrize("head_steps,conventions", [(None, "default"), (10, "default"), (1, "legacy")])
def test_engine_linear_fedrep_matches_batched_path(head_steps, conventions):
    """Half of the clients per round: the batched path replays the engine's cohorts (``ClientSampler``). Default
    conventions: zero heads, positive-diagonal QR; ``legacy``: the network's shared random head, LAPACK's QR signs."""
    n, d, k, m = 8, 6, 2, 5
    dm, fed, x, y = engine_data(n, d, k, m, participation=0.5)
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
