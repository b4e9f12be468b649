"""LinearFedAvg (spec 004 §2.1) on one client, against numpy references of τ simultaneous GD steps on (B, w):
argument checks and the paper's defaults (τ = 2, α = 0.4), both gradients with their reported losses, the dtype of
the population target, the stateless client and the missing-target error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fl_lightning.algorithms import LinearFedAvg
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import LinearRepresentation
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

D, K, N = 4, 2, 6


def np_steps(bt: np.ndarray, w: np.ndarray, grad, steps: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """B ← B − α e wᵀ, w ← w − α Bᵀ e with e = ∇_θ f at θ = Bw (B = btᵀ), both from the old values."""
    b = bt.T.copy()
    for _ in range(steps):
        e = grad(b @ w)
        b, w = b - alpha * np.outer(e, w), w - alpha * b.T @ e
    return b.T, w


def problem(dtype: torch.dtype = torch.float64) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    glob = {
        "body.weight": torch.randn(K, D, generator=g, dtype=torch.float64).to(dtype),
        "head.weight": torch.randn(1, K, generator=g, dtype=torch.float64).to(dtype),
    }
    x = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    return glob, x, y


def context(x: torch.Tensor, y: torch.Tensor, client: int = 0) -> ClientContext:
    net = LinearRepresentation(D, K).to(x.dtype)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return client_context(net, x, y, client=client, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, client))


def test_argument_checks_boundaries_and_paper_defaults():
    LinearFedAvg(local_steps=1, step_size=1e-9)
    for kwargs in ({"local_steps": 0}, {"step_size": 0.0}, {"step_size": -0.1}):
        with pytest.raises(ConfigError):
            LinearFedAvg(**kwargs)
    algo = LinearFedAvg()
    assert (algo.local_steps, algo.step_size) == (2, 0.4)  # spec 004: τ = 2, α = 0.4
    assert algo.targets is None


def test_samples_gradient_without_ground_truth_and_its_loss():
    """A fresh algorithm (no ``bind_ground_truth``) uses the empirical loss (1/2n)Σ(⟨Bw, x⟩ − y)²."""
    algo = LinearFedAvg(local_steps=3, step_size=0.3, init="model")
    glob, x, y = problem()
    up = algo.client_update(context(x, y), glob, {})
    xn, yn = x.numpy(), y.numpy()
    bt, w = np_steps(glob["body.weight"].numpy(), glob["head.weight"].numpy()[0],
                     lambda th: xn.T @ (xn @ th - yn) / N, 3, 0.3)  # fmt: skip
    assert_close_finite(up.upload["body.weight"], bt, rtol=1e-10, atol=1e-12)
    assert_close_finite(up.upload["head.weight"], w[None], rtol=1e-10, atol=1e-12)
    assert up.loss == pytest.approx(0.5 * np.mean((xn @ (bt.T @ w) - yn) ** 2), rel=1e-10)
    assert up.state == {} and up.num_samples == N


def test_population_gradient_target_dtype_and_loss():
    """f_i = ½‖Bw − θ_i*‖²: e = Bw − θ_i*; a float64 target is read in the float32 parameters' dtype."""
    algo = LinearFedAvg(local_steps=2, step_size=0.2, init="model", gradient="population")
    targets = torch.randn(3, D, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    algo.bind_ground_truth({"population_target": targets})
    glob, x, y = problem(torch.float32)
    up = algo.client_update(context(x, y, client=2), glob, {})
    theta = targets[2].numpy()
    bt, w = np_steps(glob["body.weight"].double().numpy(), glob["head.weight"].double().numpy()[0],
                     lambda th: th - theta, 2, 0.2)  # fmt: skip
    assert up.upload["body.weight"].dtype == torch.float32 and up.upload["head.weight"].dtype == torch.float32
    assert_close_finite(up.upload["body.weight"], bt, rtol=1e-5, atol=1e-6)
    assert_close_finite(up.upload["head.weight"], w[None], rtol=1e-5, atol=1e-6)
    assert up.loss == pytest.approx(0.5 * np.sum((bt.T @ w - theta) ** 2), rel=1e-4)
    assert up.state == {}


def test_population_gradient_without_targets_names_the_method():
    with pytest.raises(ConfigError, match=r"^LinearFedAvg: gradient 'population' needs"):
        LinearFedAvg(gradient="population").bind_ground_truth({})
