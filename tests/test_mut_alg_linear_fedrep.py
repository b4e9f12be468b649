"""LinearFedRep (spec 000 Alg. 2) on one client with the population loss f_i = ½‖Bw − θ_i*‖² and GD heads, the
dtypes of the stored head and the target, the server's QR convention, and the missing-target error; references in
numpy written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch.nn import functional as F

from fl_lightning.algorithms import LinearFedRep
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import LinearRepresentation

D, K = 4, 2


def context(dtype: torch.dtype, client: int = 1) -> ClientContext:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(5, generator=g, dtype=torch.float64).to(dtype)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return ClientContext(LinearRepresentation(D, K).to(dtype), client, x, y, None, opt, F.mse_loss, make_generator(0))


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
    LinearFedRep(positive_qr=positive).server_update(glob, {}, 0)
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
