"""``AdaptiveServerOptimizer``'s arguments: the accepted ranges at their edges (η > 0, β ∈ [0, 1), τ > 0,
``v₋₁ ≥ 0``), the defaults (η = 1e-2, β = (0.9, 0.99), τ = 1e-3, ``v₋₁ = τ²``, as in the module's Algorithm 2),
and that each argument reaches the step: two steps of FedAdam against Algorithm 2 written in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite

from fl_lightning.server_optimizers import FedAdagrad, FedAdam, FedYogi

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
