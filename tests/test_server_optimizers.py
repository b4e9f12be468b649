"""``fl_lightning/server_optimizers.py``: ``AdaptiveServerOptimizer``'s argument ranges and FedYogi's second
moment at a tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.server_optimizers import FedAdagrad, FedAdam, FedYogi
from tests.helpers.asserts import assert_close_finite

X0 = np.array([0.3, -1.2, 2.0])


GRADS = [np.array([0.5, -0.25, 2.0]), np.array([-1.0, 0.75, 0.1])]


def adam_reference(lr: float, betas: tuple[float, float], tau: float, v0: float) -> np.ndarray:
    """Algorithm 2 with FedAdam's v, Δ = −g, m₋₁ = 0, v₋₁ = v0, over ``GRADS``."""
    x, m, v = X0.copy(), np.zeros(3), np.full(3, v0)
    for g in GRADS:
        delta = -g
        m = betas[0] * m + (1 - betas[0]) * delta
        v = betas[1] * v + (1 - betas[1]) * delta**2
        x = x + lr * m / (np.sqrt(v) + tau)
    return x


def run_adam(**kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(torch.tensor(X0))
    opt = FedAdam([p], **kwargs)
    for g in GRADS:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach()


def test_defaults_are_algorithm_2s() -> None:
    assert_close_finite(run_adam(), adam_reference(1e-2, (0.9, 0.99), 1e-3, 1e-3**2))


@pytest.mark.parametrize(
    "kwargs, v0",
    [
        ({"lr": 0.5, "betas": (0.0, 0.0), "tau": 0.5, "initial_accumulator": 0.0}, 0.0),  # the lower edges
        ({"lr": 2.0, "betas": (0.3, 0.7), "tau": 2.5}, 2.5**2),  # distinct β₁, β₂; v₋₁ = τ²
        ({"lr": 0.05, "betas": (0.95, 0.5), "tau": 0.01, "initial_accumulator": 0.25}, 0.25),
    ],
)
def test_each_argument_reaches_the_step(kwargs: dict, v0: float) -> None:
    betas = kwargs["betas"]
    assert_close_finite(run_adam(**kwargs), adam_reference(kwargs["lr"], betas, kwargs["tau"], v0))


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0},
        {"lr": -1e-3},
        {"betas": (1.0, 0.5)},
        {"betas": (1.5, 0.5)},
        {"betas": (-0.1, 0.5)},
        {"betas": (0.5, 1.0)},
        {"betas": (0.5, 1.5)},
        {"betas": (0.5, -0.1)},
        {"tau": 0.0},
        {"tau": -0.5},
        {"initial_accumulator": -1e-6},
    ],
)
def test_out_of_range_arguments_are_refused(cls, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=cls.__name__):
        cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)


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
