"""``experiments/side_information.py``: PerFedSI's synthetic experiments (spec 002): inductive matrix completion
converges linearly with side information only, its stochastic step is the local gradient in expectation, and the
linear toy's bias floor without side information."""

from __future__ import annotations

import numpy as np

from experiments.side_information import federated_imc, imc_problem, linear_bias_toy
from tests.helpers.asserts import assert_close_finite


def test_matrix_completion_converges_linearly_with_side_information_only():
    rounds = 1000
    for seed in range(3):
        problem = imc_problem(seed=seed)  # d=16, M=20, k=4, r=2, 5 observed items per client
        assert np.bincount(problem.observed.ravel(), minlength=16).min() >= 2
        assert_close_finite(problem.L_star, problem.U_star @ problem.V_star.T @ problem.Z.T, rtol=1e-7, atol=0.0)
        with_si = federated_imc(problem, "given", rounds=rounds, seed=seed)
        assert with_si[-1] < 1e-5, (seed, with_si[-1])
        # linear convergence: log-error is a straight line in the rounds (after a short warm-up)
        t = np.arange(100, rounds + 1)
        log_err = np.log10(with_si[t])
        slope, intercept = np.polyfit(t, log_err, 1)
        r2 = 1 - ((log_err - (slope * t + intercept)) ** 2).sum() / ((log_err - log_err.mean()) ** 2).sum()
        assert slope < 0 and r2 > 0.95, (seed, slope, r2)
        for side in ("one_hot", "none"):  # the original problem (z = e_m) and a single shared prediction
            without = federated_imc(problem, side, rounds=rounds, seed=seed)
            assert without[-1] >= 100 * with_si[-1], (seed, side, without[-1], with_si[-1])


def test_imc_stochastic_step_is_the_gradient_of_the_local_loss_in_expectation():
    problem = imc_problem(seed=0)
    rng = np.random.default_rng(0)
    u, v = rng.standard_normal((16, 2)), rng.standard_normal((4, 2))
    m = 3
    zm = problem.Z[m]
    # analytic gradient of L_m = ½ Σ_i (e_iᵀ(UVᵀ − M*) z_m)² scaled by 1/d (uniform item): E[e eᵀ] = I/d
    err = (u @ v.T - problem.U_star @ problem.V_star.T) @ zm  # d
    grad_u = np.outer(err, v.T @ zm) / 16
    grad_v = np.outer(zm, err @ u) / 16
    # the per-item SGD step of federated_imc, averaged over all d items
    gu, gv = np.zeros_like(u), np.zeros_like(v)
    for i in range(16):
        res = u[i] @ v.T @ zm - problem.L_star[i, m]
        gu[i] += res * (v.T @ zm) / 16
        gv += res * np.outer(zm, u[i]) / 16
    assert_close_finite(gu, grad_u, rtol=1e-7, atol=1e-12)
    assert_close_finite(gv, grad_v, rtol=1e-7, atol=1e-12)


def test_linear_toy_bias_floor_without_side_information_and_zero_error_with_it():
    for seed in range(3):
        without = linear_bias_toy(False, clients_per_round=50, seed=seed)
        floor = without.bias_floor  # closed form (b_m − b̄)²
        assert_close_finite(without.bias_error, floor, rtol=0.01, atol=0.01 * floor.mean())
        assert_close_finite(without.excess_risk, 0.5 * floor, rtol=0.01, atol=0.01 * floor.mean())
        with_si = linear_bias_toy(True, clients_per_round=50, seed=seed)
        assert with_si.excess_risk.max() < 1e-3 * max(floor.mean(), 1.0)
        # the spec's partial participation (10 of 50 clients per round) lands on the same floor on average
        partial = linear_bias_toy(False, seed=seed)
        assert abs(partial.bias_error.mean() / floor.mean() - 1) < 0.1
        assert linear_bias_toy(True, seed=seed).excess_risk.max() < 1e-3
