"""LinearFedRep (spec 000 Alg. 2; ``fl_lightning/algorithms/linear_fedrep.py``) against references written here: its
arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from datamodules import SyntheticLinearDataModule
from fl_lightning.algorithms import LinearFedRep
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import principal_angle_distance
from fl_lightning.models import LinearRepresentation
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.training import fit


def linear_setup(m=7, d=6, k=2, seed=1):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(m, d)), rng.normal(size=m)
    b, _ = np.linalg.qr(rng.normal(size=(d, k)))
    w0 = rng.normal(size=k)
    net = LinearRepresentation(d, k)
    glob = {
        "body.weight": torch.tensor(b.T, dtype=torch.float64),
        "head.weight": torch.zeros(1, k, dtype=torch.float64),
    }
    ctx = client_context(net, torch.tensor(x), torch.tensor(y))
    return x, y, b, w0, glob, ctx


def test_linear_fedrep_exact_head_and_one_gd_step_on_b():
    x, y, b, w0, glob, ctx = linear_setup()
    eta, m = 0.1, len(y)
    upd = LinearFedRep(body_lr=eta).client_update(ctx, glob, {"head.weight": torch.tensor(w0[None])})
    w = np.linalg.lstsq(x @ b, y, rcond=None)[0]  # argmin_w ½·mean (y − wᵀBᵀx)²
    grad_b = sum((x[j] @ b @ w - y[j]) * np.outer(x[j], w) for j in range(m)) / m
    assert_close_finite(upd.state["head.weight"].numpy().ravel(), w, rtol=1e-8, atol=0.0)
    assert_close_finite(upd.upload["body.weight"].numpy().T, b - eta * grad_b, rtol=1e-8, atol=0.0)


@pytest.mark.parametrize("head_steps", [1, 10])
def test_linear_gd_gd_head_steps(head_steps):
    x, y, b, w0, glob, ctx = linear_setup()
    beta, eta, m = 0.2, 0.1, len(y)
    alg = LinearFedRep(body_lr=eta, head_solver="gd", head_steps=head_steps, head_lr=beta)
    upd = alg.client_update(ctx, glob, {"head.weight": torch.tensor(w0[None])})
    w = w0.copy()
    for _ in range(head_steps):
        w -= beta * sum((w @ b.T @ x[j] - y[j]) * (b.T @ x[j]) for j in range(m)) / m
    grad_b = sum((x[j] @ b @ w - y[j]) * np.outer(x[j], w) for j in range(m)) / m
    assert_close_finite(upd.state["head.weight"].numpy().ravel(), w, rtol=1e-8, atol=0.0)
    assert_close_finite(upd.upload["body.weight"].numpy().T, b - eta * grad_b, rtol=1e-8, atol=0.0)


def test_linear_fedrep_server_orthonormalises_b():
    alg = LinearFedRep()
    bt = torch.randn(2, 6, dtype=torch.float64)
    live = {"body.weight": nn.Parameter(bt.clone())}
    with torch.no_grad():
        alg.server_update(live, {}, RoundFacts(0, num_aggregated=1))
    q = live["body.weight"].detach().T
    assert_close_finite(q.T @ q, torch.eye(2, dtype=torch.float64))
    proj = q @ q.T  # same column span as the averaged B
    assert_close_finite(proj @ bt.T, bt.T)


D, K = 4, 2


def context(dtype: torch.dtype, client: int = 1) -> ClientContext:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(5, generator=g, dtype=torch.float64).to(dtype)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return client_context(LinearRepresentation(D, K).to(dtype), x, y, client=client, optimizer=opt, loss=F.mse_loss)


def test_population_gd_heads_body_step_and_loss_in_the_parameters_dtype():
    """3 head steps w ← w − η_h Bᵀ(Bw − θ*), one body step B ← B − η_b (Bw − θ*)wᵀ, loss ½‖Bw − θ*‖²; a float64
    target and a float64 stored head are read in the float32 body's dtype."""
    algo = LinearFedRep(body_lr=0.2, head_solver="gd", head_steps=3, head_lr=0.3, gradient="population")
    targets = torch.randn(3, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    algo.bind_ground_truth({"population_target": targets})
    g = torch.Generator().manual_seed(2)
    bt0 = torch.randn(K, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(1, K, generator=g, dtype=torch.float64)
    glob = {"body.weight": bt0.float(), "head.weight": torch.zeros(1, K)}
    up = algo.client_update(context(torch.float32), glob, {"head.weight": w0})
    b, w, theta = bt0.float().double().numpy().T, w0.float().double().numpy()[0], targets[1].numpy()
    for _ in range(3):
        w = w - 0.3 * b.T @ (b @ w - theta)
    b = b - 0.2 * np.outer(b @ w - theta, w)
    assert up.upload["body.weight"].dtype == torch.float32 and up.state["head.weight"].dtype == torch.float32
    assert_close_finite(up.state["head.weight"][0], w, rtol=1e-5, atol=1e-6)
    assert_close_finite(up.upload["body.weight"], b.T, rtol=1e-5, atol=1e-6)
    assert up.loss == pytest.approx(0.5 * np.sum((b @ w - theta) ** 2), rel=1e-4)


def test_population_without_targets_names_the_method():
    with pytest.raises(ConfigError, match=r"^LinearFedRep: gradient 'population' needs"):
        LinearFedRep(gradient="population").bind_ground_truth({})


def gram_schmidt(b: np.ndarray) -> np.ndarray:
    """Q of the QR with a positive R diagonal, by classical Gram–Schmidt."""
    q = np.zeros_like(b)
    for j in range(b.shape[1]):
        v = b[:, j] - q[:, :j] @ (q[:, :j].T @ b[:, j])
        q[:, j] = v / np.linalg.norm(v)
    return q


@pytest.mark.parametrize("positive", [True, False])
def test_server_qr_convention(positive):
    b = np.array([[2.0, 1.0], [1.0, -1.0], [0.5, 3.0], [1.0, 0.0]])  # B (d×k), positive first entry
    lapack = np.linalg.qr(b)[0]
    assert np.abs(lapack - gram_schmidt(b)).max() > 0.5  # LAPACK's R has a negative diagonal here
    glob = {"body.weight": torch.tensor(b.T.copy())}
    LinearFedRep(positive_qr=positive).server_update(glob, {}, RoundFacts(0, num_aggregated=1))
    got = glob["body.weight"].numpy().T
    if positive:
        assert_close_finite(got, gram_schmidt(b), rtol=1e-10, atol=1e-12)
    else:  # the raw factor: each column ± the Gram–Schmidt one, at least one flipped
        signs = np.sign(np.sum(got * gram_schmidt(b), axis=0))
        assert_close_finite(got, gram_schmidt(b) * signs, rtol=1e-10, atol=1e-12)
        assert (signs < 0).any()


def test_samples_exact_head_then_body_step_and_loss():
    """Exact head w = argmin (1/2m)‖XBw − y‖² (normal equations), one body step with e = Xᵀ(XBw − y)/m, and the
    reported loss (1/2m)‖XBw − y‖² after it."""
    ctx = context(torch.float64)
    g = torch.Generator().manual_seed(3)
    bt0 = torch.randn(K, D, generator=g, dtype=torch.float64)
    algo = LinearFedRep(body_lr=0.2, body_steps=1)
    up = algo.client_update(
        ctx, {"body.weight": bt0, "head.weight": torch.zeros(1, K)}, {"head.weight": torch.zeros(1, K)}
    )
    x, y, b = ctx.x.numpy(), ctx.y.numpy(), bt0.numpy().T
    f = x @ b
    w = np.linalg.solve(f.T @ f, f.T @ y)
    b = b - 0.2 * np.outer(x.T @ (x @ b @ w - y) / 5, w)
    assert_close_finite(up.state["head.weight"][0], w, rtol=1e-9, atol=1e-12)
    assert_close_finite(up.upload["body.weight"], b.T, rtol=1e-9, atol=1e-12)
    assert up.loss == pytest.approx(0.5 * np.mean((x @ b @ w - y) ** 2), rel=1e-10)


def test_argument_checks_boundaries_and_defaults():
    LinearFedRep(body_lr=1e-9, head_lr=1e-9, body_steps=0, head_steps=1)
    bad = ({"body_lr": 0.0}, {"head_lr": 0.0}, {"body_steps": -1}, {"head_steps": 0}, {"head_init": "ones"},
           {"head_solver": "newton"})  # fmt: skip
    for kwargs in bad:
        with pytest.raises(ConfigError):
            LinearFedRep(**kwargs)
    algo = LinearFedRep()
    assert (algo.body_lr, algo.body_steps, algo.head_steps, algo.head_lr) == (0.1, 1, 1, 0.1)
    assert (algo.head_solver, algo.orthonormalize, algo.positive_qr, algo.head_init) == ("exact", True, True, "zeros")


def run(algorithm, rounds=200):
    dm = SyntheticLinearDataModule(num_clients=100, dim=10, rank=2, samples_per_client=5, participation=0.1, seed=0)
    L.seed_everything(0, verbose=False)
    module = FederatedModule(algorithm, LinearRepresentation(10, 2), aggregation="uniform", eval_every=20, eval_last=1)
    fit(module, dm, rounds=rounds)
    return module, dm


def test_principal_angle_distance_matches_numpy():
    rng = np.random.default_rng(0)
    b1, b2 = rng.normal(size=(10, 2)), rng.normal(size=(10, 2))
    q1, q2 = np.linalg.qr(b1)[0], np.linalg.qr(b2)[0]
    expected = np.linalg.svd((np.eye(10) - q1 @ q1.T) @ q2, compute_uv=False)[0]
    import torch

    assert abs(float(principal_angle_distance(torch.tensor(b1), torch.tensor(b2))) - expected) < 1e-10
    assert float(principal_angle_distance(torch.tensor(b1), torch.tensor(b1 @ rng.normal(size=(2, 2))))) < 1e-7


def test_fedrep_recovers_the_representation_faster_than_gd_gd():
    """Spec 000 Fig. 3 at n=100: FedRep (exact heads) reaches B* within 200 rounds; GD-GD (zero heads, sign-fixed
    QR) converges too, but more slowly."""
    fedrep, dm = run(LinearFedRep(body_lr=0.1, head_solver="exact"))
    dist = float(principal_angle_distance(dm.federated.extras["B_star"], fedrep.net.representation.detach()))
    assert dist < 2e-2
    assert fedrep.history[-1]["val/dist_B"] == dist or abs(fedrep.history[-1]["val/dist_B"] - dist) < 1e-6
    gdgd, dm = run(LinearFedRep(body_lr=0.1, head_solver="gd", head_steps=1, head_lr=0.1))
    dist_gdgd = float(principal_angle_distance(dm.federated.extras["B_star"], gdgd.net.representation.detach()))
    assert 3 * dist < dist_gdgd < 0.5
