"""Spec 003: power initialisation + local GD on Uⁱ, alternating GD, data loaders — against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.lowrank import LowRankDataModule, synthetic_lowrank
from experiments import lowrank_mf as lm
from fl_lightning.algorithms import AlternatingGD, PowerInitLocalGD
from fl_lightning.algorithms.lowrank_power import exact_solution, local_gd, mf_loss, optimal_loss
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import LowRankFactors
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import fit

N, ROWS, D, R = 5, 40, 40, 5  # CI size; the reproduction runs the paper's 25 × 200 rows, d = 200


@pytest.fixture(scope="module")
def noisy() -> torch.Tensor:
    return synthetic_lowrank(N, ROWS, D, R, 1e-6, torch.Generator().manual_seed(2024))


@pytest.fixture(scope="module")
def clean() -> torch.Tensor:
    return synthetic_lowrank(N, ROWS, D, R, 0.0, torch.Generator().manual_seed(2024))


def np_gd(s: np.ndarray, v: np.ndarray, u: np.ndarray, steps: int, nesterov: bool) -> tuple[np.ndarray, list[float]]:
    """Independent reference of Algorithm 2 (and the k/(k+3) momentum of the paper's code)."""
    gamma = 1.0 / np.linalg.norm(v, 2) ** 2
    y, losses = u.copy(), []
    for k in range(steps):
        point = y if nesterov else u
        new = point - gamma * (point @ v.T - s) @ v
        y = new + k / (k + 3) * (new - u)
        u = new
        losses.append(0.5 * np.sum((s - u @ v.T) ** 2))
    return u, losses


def kappa_np(v: np.ndarray) -> float:
    sv = np.linalg.svd(v, compute_uv=False)
    return sv[0] / sv[-1]


def test_exact_solution_is_least_squares(noisy):
    v = torch.randn(D, R, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ref = np.linalg.lstsq(v.numpy(), noisy[:ROWS].numpy().T, rcond=None)[0].T
    assert_close_finite(exact_solution(noisy[:ROWS], v).numpy(), ref, rtol=1e-5, atol=1e-10)


def test_noise_free_local_gd_falls_linearly_below_1e_20(clean):
    v, kappa = lm.power_init(clean, R, 0, torch.Generator().manual_seed(1), 20)
    u0 = torch.randn(N * ROWS, R, generator=torch.Generator().manual_seed(2), dtype=torch.float64) / ROWS**0.5
    _, _, losses = local_gd(clean, v, u0, u0, 600, 0, False)
    f0 = mf_loss(clean, u0, v)
    ref_u, ref_losses = np_gd(clean.numpy(), v.numpy(), u0.numpy(), 600, False)
    assert_close_finite(losses[:50], ref_losses[:50], rtol=1e-9, atol=1e-8)
    assert losses[-1] < 1e-20 and mf_loss(clean, exact_solution(clean, v), v) < 1e-20
    rate = 1 - kappa**-2  # Theorem 1: F_t − F* ≤ (1 − κ⁻²)^t (F_0 − F*), F* ≈ 0 here
    for t in (50, 100, 200, 300):
        assert losses[t - 1] <= rate**t * f0 * 1.0001
    slopes = np.diff(np.log10(losses[:300:50]))  # linear in log scale: equal drops per 50 steps
    assert slopes.max() < 0 and slopes.max() / slopes.min() > 0.5


def test_alpha_one_reaches_the_optimum_alpha_zero_stops_higher(noisy):
    fmin = optimal_loss(noisy, R)
    exact = {}
    for alpha in (0, 1):
        v, _ = lm.power_init(noisy, R, alpha, torch.Generator().manual_seed(10 + alpha), 20)
        exact[alpha] = mf_loss(noisy, exact_solution(noisy, v), v)
        curve = lm.gd_curve(noisy, v, 300, True, torch.Generator().manual_seed(3), ROWS)
        assert curve[-1] <= exact[alpha] * 1.01
    assert exact[1] <= fmin * 1.001
    assert exact[0] > 1.5 * fmin


def test_nesterov_needs_fewer_iterations_than_gd_on_the_same_v(noisy):
    v, _ = lm.power_init(noisy, R, 1, torch.Generator().manual_seed(11), 20)
    target = mf_loss(noisy, exact_solution(noisy, v), v) * 1.01
    u0 = torch.randn(N * ROWS, R, generator=torch.Generator().manual_seed(3), dtype=torch.float64) / ROWS**0.5
    _, gd = np_gd(noisy.numpy(), v.numpy(), u0.numpy(), 600, False)
    _, nes = np_gd(noisy.numpy(), v.numpy(), u0.numpy(), 600, True)
    it_gd, it_nes = lm.first_below(gd, target), lm.first_below(nes, target)
    assert it_nes is not None and (it_gd is None or it_nes < it_gd)
    curve = lm.gd_curve(noisy, v, 30, True, torch.Generator().manual_seed(3), ROWS)
    assert_close_finite(curve[1:], nes[:30], rtol=1e-5, atol=1e-8)


def test_communications_alpha_plus_one_against_tens_for_alternating_gd(noisy):
    """Target F − F_min ≤ 10·F_min (the reproduction uses the paper's −5.5 at full size)."""
    fmin = optimal_loss(noisy, R)
    v, _ = lm.power_init(noisy, R, 0, torch.Generator().manual_seed(10), 20)
    curve = lm.gd_curve(noisy, v, 300, True, torch.Generator().manual_seed(3), ROWS)
    assert lm.first_below([f - fmin for f in curve], 10 * fmin) is not None  # α = 0: one communication
    wk = lm.alternating_gd(noisy, R, 100, torch.Generator().manual_seed(4))
    iters = lm.first_below([f - fmin for f in wk], 10 * fmin)
    assert iters is not None and iters + 1 >= 10  # one V exchange per iteration: tens


def small_module(algorithm, rounds: int, seed: int = 0, rows: int = 30) -> tuple[FederatedModule, torch.Tensor]:
    dm = LowRankDataModule("synthetic", num_clients=4, rows_per_client=rows, dim=12, rank=3, noise=0.01, seed=seed)
    module = FederatedModule(algorithm, LowRankFactors(12, 3, rows), eval_every=1000, eval_last=1)
    fit(module, dm, rounds, seed)
    return module, dm.federated.train.y


@pytest.mark.parametrize("nesterov", [False, True])
def test_engine_power_init_and_local_gd_against_numpy(nesterov):
    alpha, m, steps, local_rounds = 2, 3, 4, 3
    algo = PowerInitLocalGD(alpha=alpha, sketches=m, local_steps=steps, nesterov=nesterov)
    module, s = small_module(algo, alpha + 1 + local_rounds)
    sn = s.numpy()
    blocks = [sn[30 * c : 30 * (c + 1)] for c in range(4)]
    phis = [
        torch.randn(m, 30, 3, generator=make_generator(0, "train", 0, c), dtype=torch.float64).numpy() for c in range(4)
    ]
    cands = [np.linalg.matrix_power(sn.T @ sn, alpha) @ sn.T @ np.concatenate([p[j] for p in phis]) for j in range(m)]
    best = cands[int(np.argmin([kappa_np(c) for c in cands]))]
    v = module.net.V.detach().numpy()
    assert_close_finite(v, best, rtol=1e-9, atol=1e-9 * np.abs(best).max())
    assert_close_finite(module.algorithm.kappa.numpy(), [kappa_np(c) for c in cands], rtol=1e-5, atol=1e-8)
    for c in range(4):
        u0 = (
            torch.randn(30, 3, generator=make_generator(0, "train", alpha + 1, c), dtype=torch.float64).numpy()
            / 30**0.5
        )
        ref, _ = np_gd(blocks[c], best, u0, steps * local_rounds, nesterov)
        assert_close_finite(module.bank.row("U")[c].numpy(), ref, rtol=1e-5, atol=1e-9)


def test_engine_alternating_gd_against_numpy():
    algo = AlternatingGD(sigma_rounds=40, seed=0)
    module, s = small_module(algo, 40 + 5)
    sn = s.numpy()
    g = make_generator(0, "wk-init")
    torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randn(12, 3, generator=g, dtype=torch.float64)
    vec = torch.randn(12, generator=g, dtype=torch.float64).numpy()
    vec = vec / np.linalg.norm(vec)
    for _ in range(40):  # the federated power iteration for σ_max(S), as one matrix
        total = sn.T @ (sn @ vec)
        vec, norm = total / np.linalg.norm(total), np.linalg.norm(total)
    assert float(algo.sigma) == pytest.approx(np.sqrt(norm), rel=1e-12)
    assert float(algo.sigma) <= np.linalg.norm(sn, 2) * (1 + 1e-12)
    eta, dd = float(algo.eta), 8 * 0.5 / 9
    u = sn @ algo.phi_u.numpy() / (np.sqrt(eta) * float(algo.sigma) * 8)
    v = np.sqrt(eta) * float(algo.sigma) * dd * algo.phi_v.numpy()
    for _ in range(5):
        u = u - eta * (u @ v.T - sn) @ v
        v = v - eta * (u @ v.T - sn).T @ u
    assert_close_finite(module.net.V.detach().numpy(), v, rtol=1e-5, atol=1e-10)
    assert_close_finite(module.bank.row("U").reshape(-1, 3).numpy(), u, rtol=1e-5, atol=1e-10)


def test_bad_configs_fail_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="path"):
        LowRankDataModule("w8a", path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="num_clients must be 10"):
        LowRankDataModule("digits", num_clients=5)
    with pytest.raises(ConfigError, match="max_rows"):
        dm = LowRankDataModule("synthetic", num_clients=2, rows_per_client=8, dim=6, rank=2)
        fit(FederatedModule(PowerInitLocalGD(alpha=0), LowRankFactors(6, 2, 4)), dm, 2)


# CLI overrides that shrink configs/lowrank_mf/synthetic.yaml to CI size (also used by the DDP test)
SMALL_SYNTHETIC_ARGS = [
    "--data.init_args.num_clients",
    "4",
    "--data.init_args.rows_per_client",
    "30",
    "--data.init_args.dim",
    "12",
    "--data.init_args.rank",
    "3",
    "--model.network.init_args.dim",
    "12",
    "--model.network.init_args.rank",
    "3",
    "--model.network.init_args.max_rows",
    "30",
]


def test_train_py_resume_gives_identical_results(tmp_path):
    from fl_lightning.cli import train_config

    cfg = ["configs/lowrank_mf/synthetic.yaml"]
    common = [
        *SMALL_SYNTHETIC_ARGS,
        "--checkpoint_every",
        "3",
        "--model.eval_every",
        "3",
    ]
    train_config(cfg, [*common, "--trainer.max_steps", "9"], tmp_path / "full")
    train_config(cfg, [*common, "--trainer.max_steps", "6"], tmp_path / "part")
    train_config(cfg, [*common, "--trainer.max_steps", "9", "--ckpt_path", "last"], tmp_path / "part")
    a = torch.load(tmp_path / "full" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "part" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "bank.U" in a and "algorithm.candidates" in a
    assert "mf/loss" in (tmp_path / "part" / "metrics.csv").read_text()
