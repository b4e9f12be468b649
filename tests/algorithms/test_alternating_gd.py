"""Ward–Kolda alternating GD (``AlternatingGD``) driven round by round by hand, every client's upload, state and loss
and the server's V against a numpy reference of spec 003 §2.4, with clients of different row counts (U padded to
the largest), non-default μ and C, and two σ rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fl_lightning.algorithms import AlternatingGD
from fl_lightning.algorithms.alternating_gd import wk_constants
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import LowRankFactors
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

D, R, ROWS = 6, 2, [5, 3, 4]  # client 1 and 2 have fewer rows than U's 5


MAX_ROWS, MU, C, SIGMA_ROUNDS, SEED = max(ROWS), 0.4, 6.0, 2, 3


def blocks() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    v_star = rng.normal(size=(D, R))
    return [rng.normal(size=(n, R)) @ v_star.T + 0.05 * rng.normal(size=(n, D)) for n in ROWS]


def test_wk_constants_are_the_codes_eta_and_d():
    eta, dd = wk_constants(2.5, 0.4, 6.0)
    assert eta == pytest.approx(9 / (4 * 6.0 * 0.4 * 2.5), rel=1e-15)
    assert dd == pytest.approx(6.0 * 0.4 / 9, rel=1e-15)
    eta, dd = wk_constants(2.5)  # the code's defaults μ = 0.5, C = 8
    assert eta == pytest.approx(9 / (4 * 8 * 0.5 * 2.5), rel=1e-15)
    assert dd == pytest.approx(8 * 0.5 / 9, rel=1e-15)


def test_alternating_gd_defaults_are_the_papers_code():
    algo = AlternatingGD()
    assert (algo.mu, algo.c, algo.sigma_rounds, algo.seed) == (0.5, 8.0, 30, 0)


@pytest.mark.parametrize("rounds, ok", [(0, False), (1, True)])
def test_alternating_gd_needs_at_least_one_sigma_round(rounds, ok):
    if ok:
        assert AlternatingGD(sigma_rounds=rounds).sigma_rounds == 1
        return
    with pytest.raises(ConfigError, match="AlternatingGD: sigma_rounds must be ≥ 1, got 0"):
        AlternatingGD(sigma_rounds=rounds)


def test_alternating_gd_rounds_equal_the_numpy_reference():
    s = blocks()
    net = LowRankFactors(D, R, MAX_ROWS)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = AlternatingGD(mu=MU, c=C, sigma_rounds=SIGMA_ROUNDS, seed=SEED)
    algo.setup(glob, len(ROWS))

    g = make_generator(SEED, "wk-init")
    phi_u = torch.randn(D, R, generator=g, dtype=torch.float64).numpy() / D
    phi_v = torch.randn(D, R, generator=g, dtype=torch.float64).numpy() / R
    vec = torch.randn(D, generator=g, dtype=torch.float64).numpy()
    vec = vec / np.linalg.norm(vec)
    assert_close_finite(algo.phi_u, phi_u, rtol=1e-12, atol=0)
    assert_close_finite(algo.phi_v, phi_v, rtol=1e-12, atol=0)
    assert_close_finite(algo.power_vec, vec, rtol=1e-12, atol=0)
    template = algo.upload_template(glob)
    assert sorted(template) == ["grad_V", "power"] and template["grad_V"].shape == (D, R)
    assert template["power"].shape == (D,)

    states = [algo.init_client_state(glob) for _ in ROWS]
    assert all(st["U"].shape == (MAX_ROWS, R) and float(st["U"].abs().max()) == 0.0 for st in states)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)

    u_ref: list[np.ndarray] = [np.zeros((0, R))] * len(ROWS)
    v_ref = np.zeros((D, R))
    sigma = eta = 0.0
    for rnd in range(SIGMA_ROUNDS + 3):
        uploads = []
        for c, block in enumerate(s):
            ctx = client_context(
                net, torch.arange(ROWS[c]), torch.tensor(block), client=c, optimizer=opt, loss=F.mse_loss,
                generator=make_generator(0, c), round_idx=rnd,
            )
            up = algo.client_update(ctx, glob, states[c])
            assert up.num_samples == 1  # every client counts once in the average
            uploads.append(up.upload)
            if rnd < SIGMA_ROUNDS:
                assert_close_finite(up.upload["power"], block.T @ (block @ vec), rtol=1e-10, atol=1e-12)
                assert float(up.upload["grad_V"].abs().max()) == 0.0
                assert_close_finite(up.state["U"], states[c]["U"], rtol=0, atol=0)
            else:
                if rnd == SIGMA_ROUNDS:
                    u_ref[c] = block @ phi_u / (np.sqrt(eta) * sigma * C)
                u = u_ref[c] - eta * (u_ref[c] @ v_ref.T - block) @ v_ref
                grad = (u @ v_ref.T - block).T @ u
                u_ref[c] = u
                assert_close_finite(up.upload["grad_V"], grad, rtol=1e-9, atol=1e-12, msg=f"round {rnd} client {c}")
                assert float(up.upload["power"].abs().max()) == 0.0
                padded = np.zeros((MAX_ROWS, R))
                padded[: ROWS[c]] = u
                assert_close_finite(up.state["U"], padded, rtol=1e-9, atol=1e-12)
                assert up.loss == pytest.approx(0.5 * np.sum((block - u @ v_ref.T) ** 2), rel=1e-10)
            states[c] = up.state
        averaged = {n: sum(u[n] for u in uploads) / len(uploads) for n in uploads[0]}
        algo.server_update(glob, averaged, RoundFacts(rnd, num_aggregated=len(uploads)))
        if rnd < SIGMA_ROUNDS:
            total = sum(b.T @ (b @ vec) for b in s)
            vec, norm = total / np.linalg.norm(total), np.linalg.norm(total)
            assert_close_finite(algo.power_vec, vec, rtol=1e-10, atol=1e-12)
            if rnd == SIGMA_ROUNDS - 1:
                sigma = np.sqrt(norm)
                eta = 9 / (4 * C * MU * sigma)
                v_ref = np.sqrt(eta) * sigma * (C * MU / 9) * phi_v
                assert float(algo.sigma) == pytest.approx(sigma, rel=1e-12)
                assert float(algo.eta) == pytest.approx(eta, rel=1e-12)
            else:
                assert float(algo.sigma) == 0.0 and float(glob["V"].abs().max()) == 0.0
        else:
            v_ref = v_ref - eta * sum((u @ v_ref.T - b).T @ u for u, b in zip(u_ref, s))
        assert_close_finite(glob["V"], v_ref, rtol=1e-9, atol=1e-12, msg=f"V after round {rnd}")
    assert float(np.abs(v_ref).max()) > 1e-3


def test_alternating_gd_reads_the_clients_rows_in_the_factors_dtype():
    """S given in float32 to float64 factors is cast to float64 first (the σ round's SᵀS v in float64)."""
    block = blocks()[0]
    net = LowRankFactors(D, R, MAX_ROWS)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = AlternatingGD(sigma_rounds=1)
    algo.setup(glob, 1)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    s32 = torch.tensor(block, dtype=torch.float32)
    ctx = client_context(
        net, torch.arange(ROWS[0]), s32, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, 0),
    )
    up = algo.client_update(ctx, glob, algo.init_client_state(glob))
    assert up.upload["power"].dtype == torch.float64
    s = s32.double().numpy()
    assert_close_finite(up.upload["power"], s.T @ (s @ algo.power_vec.numpy()), rtol=1e-12, atol=1e-12)
