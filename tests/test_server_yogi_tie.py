"""FedYogi's second moment when ``v_{t−1} = Δ_t²`` exactly: ``sign(0) = 0``, so ``v`` stays put (no division by
the sign), and the step is the plain Algorithm 2 step with that ``v``. Reference: the formula in numpy."""

from __future__ import annotations

import numpy as np
import torch
from helpers import assert_close_finite

from fl_lightning.server_optimizers import FedYogi


def yogi_step(x: np.ndarray, grad: np.ndarray, v0: float, lr: float, betas: tuple[float, float], tau: float):
    """One step of Algorithm 2 with Yogi's ``v`` from zero momentum; returns ``(x_new, v_new)``."""
    delta = -grad
    m = (1 - betas[0]) * delta
    v = v0 - (1 - betas[1]) * delta**2 * np.sign(v0 - delta**2)
    return x + lr * m / (np.sqrt(v) + tau), v


def test_yogi_keeps_v_when_it_equals_the_squared_update() -> None:
    # entries 0 and 1 tie (Δ² = 4 = v₋₁), entry 2 has Δ² > v₋₁, entry 3 has Δ² < v₋₁
    grad = np.array([2.0, -2.0, 3.0, 1.0])
    x0 = np.array([0.5, -1.0, 2.0, 0.0])
    lr, betas, tau, v0 = 0.1, (0.9, 0.99), 1e-3, 4.0
    p = torch.nn.Parameter(torch.tensor(x0))
    opt = FedYogi([p], lr=lr, betas=betas, tau=tau, initial_accumulator=v0)
    p.grad = torch.tensor(grad)
    opt.step()
    x_ref, v_ref = yogi_step(x0, grad, v0, lr, betas, tau)
    assert v_ref[0] == v_ref[1] == v0
    assert_close_finite(opt.state[p]["v"], v_ref)
    assert_close_finite(p.detach(), x_ref)


def test_yogi_with_zero_accumulator_and_zero_update_stays_finite() -> None:
    """``v₋₁ = 0`` and a zero gradient: Δ² = v = 0, nothing moves and nothing becomes NaN."""
    p = torch.nn.Parameter(torch.tensor([1.0, -3.0], dtype=torch.float64))
    opt = FedYogi([p], lr=0.1, initial_accumulator=0.0)
    p.grad = torch.zeros(2, dtype=torch.float64)
    opt.step()
    assert_close_finite(opt.state[p]["v"], np.zeros(2))
    assert_close_finite(p.detach(), np.array([1.0, -3.0]))
