"""The papers' experiments at other settings, through train.py (issue 18), against numpy references written here.

* low-rank MF (spec 003) with a non-flat spectrum: κ(V) and the optimum for α = 0 and α = 1;
* spec 004 with population gradients in float64: FedAvg τ = 2 reaches B* to < 1e-10, D-GD stays > 0.9, and new
  clients fine-tune through the held-out-client path;
* FedRep's GD-GD (spec 000) with zero heads and the positive-diagonal QR;
* float64 end to end; sizes set once; every generator constant as a validated argument; the cluster distance
  with fewer models than clusters; the oracle start; mixed regression at any setting.
"""

from __future__ import annotations

import itertools
import json
import math

import lightning as L
import numpy as np
import pytest
import torch

from datamodules import LowRankDataModule, MixedRegressionDataModule, SyntheticLinearDataModule
from fl_lightning.algorithms import LinearFedAvg, LinearFedRep
from fl_lightning.algorithms.linear_fedrep import orthonormalize
from fl_lightning.cli import main, train_config
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler, make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import cluster_model_distance
from fl_lightning.models import LinearRepresentation, LowRankFactors
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.training import fit

QUIET = ["--trainer.enable_checkpointing=false"]


def np_dist(b_star: np.ndarray, b: np.ndarray) -> float:
    q = np.linalg.qr(b)[0]
    return float(np.linalg.norm((np.eye(len(b_star)) - b_star @ b_star.T) @ q, 2))


def history(run_dir) -> list[dict]:
    return json.loads((run_dir / "history.json").read_text())


# ---- spec 003: low-rank MF with singular values linspace(1, 0.5) --------------------------------------------
MF = dict(num_clients=4, rows_per_client=30, dim=12, rank=3, noise=1e-3)


MF_ARGS = [f"--data.init_args.{k}={v}" for k, v in MF.items()] + ["--model.algorithm.init_args.sketches=1"]


def np_power_gd(s: np.ndarray, alpha: int, phis: list[np.ndarray], u0s: list[np.ndarray], steps: int):
    """Algorithm 1 (V = (SᵀS)^α SᵀΦ) then ``steps`` plain GD steps with γ = 1/σ_max²(V) on every client's U."""
    v = np.linalg.matrix_power(s.T @ s, alpha) @ s.T @ np.concatenate(phis)
    gamma, rows = 1.0 / np.linalg.norm(v, 2) ** 2, len(phis[0])
    loss = 0.0
    for c, u in enumerate(u0s):
        block = s[c * rows : (c + 1) * rows]
        for _ in range(steps):
            u = u - gamma * (u @ v.T - block) @ v
        loss += 0.5 * np.sum((block - u @ v.T) ** 2)
    sv = np.linalg.svd(v, compute_uv=False)
    return sv[0] / sv[-1], loss


def test_lowrank_linspace_tradeoff_through_train_py(tmp_path):
    """Spec 003 with σ = linspace(1, 0.5): α = 1 has the larger κ(V) and reaches F_min; α = 0 stops above it.
    The numbers are those of a numpy run of Algorithms 1 and 2 on the same matrix, Φ and U₀."""
    dm = LowRankDataModule("synthetic", **MF, singular_values={"linspace": [1, 0.5]}, seed=2024)
    dm.setup()
    s = dm.federated.train.y.numpy()
    f_min = 0.5 * np.sum(np.linalg.svd(s, compute_uv=False)[3:] ** 2)
    rounds, steps = 20, 1000  # κ(V) ≈ 32 for α = 1 here: plain GD needs ~κ² log(1/ε) steps
    out = {}
    for alpha in (0, 1):
        summary = train_config(
            ["configs/lowrank_mf/synthetic.yaml", "configs/lowrank_mf/linspace.yaml"],
            [*MF_ARGS, *QUIET, f"--model.algorithm.init_args.alpha={alpha}",
             f"--model.algorithm.init_args.local_steps={steps}", f"--trainer.max_steps={alpha + 1 + rounds}"],
            run_dir=tmp_path / f"alpha{alpha}",
        )  # fmt: skip
        phis = [torch.randn(1, 30, 3, generator=make_generator(2024, "train", 0, c), dtype=torch.float64)[0].numpy()
                for c in range(4)]  # fmt: skip
        u0s = [torch.randn(30, 3, generator=make_generator(2024, "train", alpha + 1, c), dtype=torch.float64).numpy()
               / 30**0.5 for c in range(4)]  # fmt: skip
        kappa, loss = np_power_gd(s, alpha, phis, u0s, steps * rounds)
        assert summary["mf_kappa_V"] == pytest.approx(kappa, rel=1e-9)
        assert summary["mf_loss"] == pytest.approx(loss, rel=1e-8)
        assert summary["mf_loss_min"] == pytest.approx(f_min, rel=1e-10)
        out[alpha] = (kappa, loss)
    assert out[1][0] > 1.5 * out[0][0]  # the power step worsens the conditioning ...
    assert out[1][1] - f_min < 1e-3 * f_min  # ... but α = 1 reaches the optimum
    assert out[0][1] - f_min > 0.5 * f_min  # and α = 0 stops well above it


def test_lowrank_network_sizes_come_from_the_data(tmp_path):
    summary = train_config(
        ["configs/lowrank_mf/synthetic.yaml"], [*MF_ARGS, *QUIET, "--trainer.max_steps=3"], tmp_path / "a"
    )
    assert summary["rounds"] == 3
    cfg = (tmp_path / "a" / "config.yaml").read_text()
    assert "max_rows: 30" in cfg and "dim: 12" in cfg
    # the factorisation rank may differ from the matrix's rank (spec 003 Thm 3); the dimension may not
    summary = train_config(["configs/lowrank_mf/synthetic.yaml"],
                           [*MF_ARGS, *QUIET, "--trainer.max_steps=3", "--model.network.init_args.rank=2"],
                           tmp_path / "b")  # fmt: skip
    assert summary["rounds"] == 3
    with pytest.raises(ConfigError, match=r"model.network.init_args.dim=13 but data.init_args.dim=12"):
        train_config(["configs/lowrank_mf/synthetic.yaml"], [*MF_ARGS, "--model.network.init_args.dim=13"], tmp_path)
    assert LowRankFactors(12, 3, 30).U.shape == (30, 3)


# ---- spec 004: population gradients in float64 ---------------------------------------------------------------
S004 = dict(num_clients=10, dim=20, rank=2, samples_per_client=5, new_clients=3, new_client_samples=20)


S004_ARGS = [f"--data.init_args.{k}={v}" for k, v in S004.items()] + ["--seed_everything=1", "--model.eval_every=25"]


def np_fedavg_population(b, w, thetas, alpha, tau, rounds, b_star, every):
    """Spec 004 §2.1: τ simultaneous GD steps on ½‖Bw − θᵢ*‖² per client, then the average of B and w."""
    dists = []
    for t in range(rounds):
        bs, ws = [], []
        for theta in thetas:
            bi, wi = b.copy(), w.copy()
            for _ in range(tau):
                e = bi @ wi - theta
                bi, wi = bi - alpha * np.outer(e, wi), wi - alpha * bi.T @ e
            bs.append(bi)
            ws.append(wi)
        b, w = np.mean(bs, 0), np.mean(ws, 0)
        if (t + 1) % every == 0:
            dists.append(np_dist(b_star, b))
    return b, w, dists


def np_finetune_error(b, w, x, y, theta, steps=200, lr=0.01):
    """Spec 004 §2.3: GD on (1/2n)Σ(⟨Bw, x⟩ − y)² over B and w from the trained model; ‖Bw − θ*‖²."""
    for _ in range(steps):
        r = x @ (b @ w) - y
        g = x.T @ r / len(y)
        b, w = b - lr * np.outer(g, w), w - lr * b.T @ g
    return float(np.sum((b @ w - theta) ** 2))


@pytest.fixture(scope="module")
def spec004_data():
    dm = SyntheticLinearDataModule(**S004, heads="gaussian", noise_variance=0.0, participation=1.0, seed=1)
    dm.setup()
    L.seed_everything(1, verbose=False)
    b_init = LinearRepresentation(20, 2).body.weight.detach().T.double().numpy()  # what train.py draws
    q = np.linalg.qr(b_init)[0]
    b0 = (torch.tensor(q) / 0.4**0.5).float().double().numpy()  # B₀ = Q/√α, stored in the float32 network
    return dm, b0


def test_spec004_population_gradients_float64_through_train_py(tmp_path, spec004_data):
    dm, b0 = spec004_data
    fed, new = dm.federated, dm.new_clients
    b_star, thetas = fed.extras["B_star"].numpy(), fed.extras["population_target"].numpy()
    rounds = 250
    results = {}
    for name, tau in (("linear_fedavg", 2), ("linear_dgd", 1)):
        run_dir = tmp_path / name
        summary = train_config(
            ["configs/representation/linear_base.yaml", f"configs/representation/{name}.yaml"],
            [*S004_ARGS, *QUIET, f"--trainer.max_steps={rounds}"],
            run_dir=run_dir,
        )
        b, w, dists = np_fedavg_population(b0, np.zeros(2), thetas, 0.4, tau, rounds, b_star, 25)
        engine = [h["val/dist_B"] for h in history(run_dir)]
        assert_close_finite(engine, dists, rtol=1e-6, atol=1e-13)
        x, y = new.train.x.numpy().reshape(3, 20, 20), new.train.y.numpy().reshape(3, 20)
        ft = np.mean([np_finetune_error(b, w, x[c], y[c], new.extras["population_target"][c].numpy())
                      for c in range(3)])  # fmt: skip
        assert summary["new_clients_mse"] == pytest.approx(ft, rel=1e-6)
        results[tau] = (summary["dist_B"], summary["new_clients_mse"])
    assert results[2][0] < 1e-10  # FedAvg learns B* at a linear rate, to float64 precision
    assert results[1][0] > 0.9  # D-GD does not (spec 004 Proposition 2)
    assert results[2][1] < 0.2 * results[1][1]  # and its representation fine-tunes better for new clients


def test_population_gradient_needs_ground_truth_and_float64_is_end_to_end(spec004_data):
    dm, _ = spec004_data
    module = FederatedModule(LinearFedAvg(2, 0.4, gradient="population"), LinearRepresentation(20, 2),
                             aggregation="uniform", eval_every=2, eval_last=1)  # fmt: skip
    fit(module, dm, rounds=2, precision="64-true")
    assert module.net.body.weight.dtype == torch.float64 and module.fed.train.x.dtype == torch.float64
    assert module.ledger.upload_bytes == 10 * (20 * 2 + 2) * 8  # float64 uploads of B and w by 10 clients
    fedrep = FederatedModule(LinearFedRep(head_solver="gd"), LinearRepresentation(20, 2), aggregation="uniform")
    fit(fedrep, dm, rounds=1, precision="64-true")
    assert fedrep.bank.row("head.weight").dtype == torch.float64
    digits_like = MixedRegressionDataModule(setting=None, sizes="4x3", num_clusters=2, dim=20, seed=0)
    with pytest.raises(ConfigError, match="population targets"):
        fit(FederatedModule(LinearFedAvg(gradient="population"), LinearRepresentation(20, 2)), digits_like, 1)


def test_population_fedrep_exact_head_is_least_squares_on_b():
    """One client, population loss: w = argmin ½‖Bw − θ*‖², then B ← B − η(Bw − θ*)wᵀ."""
    dm = SyntheticLinearDataModule(num_clients=1, dim=5, rank=2, seed=0)
    dm.setup()
    theta = dm.federated.extras["population_target"][0].numpy()
    algo = LinearFedRep(body_lr=0.3, gradient="population")
    algo.bind_ground_truth(dm.federated.extras)
    b = np.linalg.qr(np.random.default_rng(0).normal(size=(5, 2)))[0]

    x, y = dm.federated.train.client(0)
    ctx = client_context(LinearRepresentation(5, 2), x, y)
    upd = algo.client_update(ctx, {"body.weight": torch.tensor(b.T)}, {"head.weight": torch.zeros(1, 2)})
    w = np.linalg.lstsq(b, theta, rcond=None)[0]
    assert_close_finite(upd.state["head.weight"].numpy().ravel(), w, rtol=1e-10, atol=0)
    assert_close_finite(upd.upload["body.weight"].numpy().T, b - 0.3 * np.outer(b @ w - theta, w), atol=1e-12, rtol=0)


# ---- spec 000: GD-GD with zero heads and the positive-diagonal QR ---------------------------------------------
def np_qr_positive(b: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(b)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def np_gdgd(x, y, b, cohorts, rounds, eta=0.1, beta=0.1):
    """GD-GD (spec 000 §2.3): one head GD step from the stored head (0 at first), one body GD step, average, QR."""
    n, m, _ = x.shape
    heads = np.zeros((n, b.shape[1]))
    for t in range(rounds):
        bs = []
        for i in cohorts(t):
            f = x[i] @ b
            heads[i] = heads[i] - beta * f.T @ (f @ heads[i] - y[i]) / m
            bs.append(b - eta * np.outer(x[i].T @ (f @ heads[i] - y[i]) / m, heads[i]))
        b = np_qr_positive(np.mean(bs, 0))
    return b, heads


def test_gdgd_zero_heads_positive_qr_through_train_py_matches_numpy(tmp_path):
    """configs/representation/gdgd.yaml (zero heads, positive-diagonal QR) in float64 at a small setting equals the
    numpy GD-GD above on the same data, start and cohorts, and learns B* from a random start."""
    n, d, k, m, rounds = 40, 8, 2, 6, 300
    train_config(
        ["configs/representation/fedrep_base.yaml", "configs/representation/gdgd.yaml"],
        [f"--data.init_args.num_clients={n}", f"--data.init_args.dim={d}", f"--data.init_args.rank={k}",
         f"--data.init_args.samples_per_client={m}", "--data.init_args.participation=0.25", "--seed_everything=3",
         "--trainer.precision=64-true", f"--trainer.max_steps={rounds}", f"--checkpoint_every={rounds}"],
        run_dir=tmp_path,
    )  # fmt: skip
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    dm = SyntheticLinearDataModule(n, d, k, m, noise_variance=1e-3, participation=0.25, seed=3)
    dm.setup()
    fed = dm.federated
    L.seed_everything(3, verbose=False)
    b0 = LinearRepresentation(d, k).body.weight.detach().T.double().numpy()  # the start train.py draws
    x, y = fed.train.x.numpy().reshape(n, m, d), fed.train.y.numpy().reshape(n, m)
    sampler = ClientSampler(n, 10, 3)
    b, heads = np_gdgd(x, y, b0, lambda t: sampler.sample(t).tolist(), rounds)
    assert state["net.body.weight"].dtype == torch.float64
    assert_close_finite(state["net.body.weight"].T.numpy(), b, atol=1e-10, rtol=0)
    assert_close_finite(state["bank.head__weight"][:, 0].numpy(), heads, atol=1e-10, rtol=0)
    b_star = fed.extras["B_star"].numpy()
    assert np_dist(b_star, b0) > 0.9 and np_dist(b_star, b) < 0.1  # it learns B* from a random start


def test_positive_qr_is_the_unique_qr_with_positive_r_diagonal():
    b = torch.randn(5, 7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = orthonormalize(b)
    r = q.transpose(-1, -2) @ b
    assert_close_finite(q.transpose(-1, -2) @ q, torch.eye(3, dtype=torch.float64).expand(5, 3, 3), rtol=0, atol=1e-12)
    assert_close_finite(r, r.triu(), rtol=0, atol=1e-12)
    assert bool((torch.diagonal(r, dim1=-2, dim2=-1) > 0).all())
    assert_close_finite(q[0].numpy(), np_qr_positive(b[0].numpy()), atol=1e-12, rtol=0)
    # an orthonormal B keeps its column signs (the stored heads of unsampled clients keep their meaning)
    assert_close_finite(orthonormalize(q), q, rtol=0, atol=1e-12)


# ---- shared sizes, generator arguments ------------------------------------------------------------------------
def test_dimension_set_once_reaches_network_and_contradictions_are_one_line(tmp_path, capsys):
    cfg = ["configs/representation/fedrep_base.yaml", "configs/representation/gdgd.yaml"]
    small = ["--data.init_args.num_clients=10", "--trainer.max_steps=2", *QUIET]
    summary = train_config(cfg, [*small, "--data.init_args.dim=7", "--data.init_args.rank=3"], tmp_path / "ok")
    assert summary["rounds"] == 2 and 0 <= summary["dist_B"] <= 1
    saved = (tmp_path / "ok" / "config.yaml").read_text()
    assert saved.count("dim: 7") == 2 and saved.count("rank: 3") == 2  # data and network
    args = ["--config", cfg[0], "--config", cfg[1], *small, "--data.init_args.dim=7",
            "--model.network.init_args.dim=9", "--run_dir", str(tmp_path / "bad")]  # fmt: skip
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert err == ["error: model.network.init_args.dim=9 but data.init_args.dim=7: set it once, in data "
                   "(the network takes it from there)"]  # fmt: skip


# ---- spec 001: distance with fewer models, oracle start, any setting -------------------------------------------
def brute_force_distance(est: np.ndarray, star: np.ndarray) -> float:
    """min over injective maps true cluster → model of the largest error (k̂ ≥ k), by enumeration."""
    k_hat, k = len(est), len(star)
    maps = itertools.permutations(range(k_hat), k)
    return min(max(np.linalg.norm(est[p[j]] - star[j]) for j in range(k)) for p in maps)


def test_cluster_distance_defined_for_any_number_of_models():
    rng = np.random.default_rng(1)
    star = rng.normal(size=(4, 5))
    for k_hat in (4, 5, 6):
        est = rng.normal(size=(k_hat, 5))
        d, perm = cluster_model_distance(torch.tensor(est), torch.tensor(star))
        assert d == pytest.approx(brute_force_distance(est, star), rel=1e-12)
        assert len(set(perm)) == 4 and max(np.linalg.norm(est[perm[j]] - star[j]) for j in range(4)) == pytest.approx(d)
    for k_hat in (1, 2, 3):  # fewer models than clusters: each cluster is served by its closest model
        est = rng.normal(size=(k_hat, 5))
        d, perm = cluster_model_distance(torch.tensor(est), torch.tensor(star))
        expected = max(min(np.linalg.norm(e - s) for e in est) for s in star)
        assert math.isfinite(d) and d == pytest.approx(expected, rel=1e-12)
        assert all(np.linalg.norm(est[perm[j]] - star[j]) <= expected + 1e-12 for j in range(4))


MR = ["--data.init_args.setting=null", "--data.init_args.sizes=12x6,4x20", "--data.init_args.probs=[0.5, 0.3, 0.2]",
      "--data.init_args.dim=5", "--data.init_args.noise=0.1", "--model.network.init_args.num_clusters=3"]  # fmt: skip


def test_global_fedavg_distance_is_finite_through_train_py(tmp_path):
    """One model for three clusters: d(θ̂, θ*) = max_j ‖θ̂ − θ*_j‖ (was ``inf``: no permutation of one model)."""
    summary = train_config(["configs/mixed_regression/c1.yaml", "configs/mixed_regression/fedavg.yaml"],
                           [*MR, "--model.network.init_args.num_clusters=1", "--trainer.max_steps=3",
                            "--checkpoint_every=3"], tmp_path)  # fmt: skip
    dm = MixedRegressionDataModule(setting=None, sizes="12x6,4x20", probs=[0.5, 0.3, 0.2], dim=5, noise=0.1, seed=0)
    dm.setup()
    star = dm.federated.extras["theta_star"].numpy()
    theta = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]["net.theta"].numpy()
    assert theta.shape == (1, 5) and summary["mr_cluster_error"] == 0.0
    assert summary["mr_dist_theta"] == pytest.approx(max(np.linalg.norm(theta[0] - s) for s in star), rel=1e-12)


def np_fedx_round(x, y, ptr, theta, lr, steps):
    """One FedX+clustering round (spec 001 §2.3): each client picks its best model, s GD steps on it, average nᵢ/N."""
    new, total = theta.copy(), ptr[-1]
    for c in range(len(ptr) - 1):
        xi, yi = x[ptr[c] : ptr[c + 1]], y[ptr[c] : ptr[c + 1]]
        z = int(np.argmin([np.sum((yi - xi @ t) ** 2) for t in theta]))
        t = theta[z].copy()
        for _ in range(steps):
            t = t - lr / len(yi) * xi.T @ (xi @ t - yi)
        new[z] += len(yi) / total * (t - theta[z])
    return new


def test_oracle_starts_from_the_ground_truth(tmp_path):
    train_config(["configs/mixed_regression/c1.yaml", "configs/mixed_regression/oracle.yaml"],
                 [*MR, "--trainer.max_steps=2", "--checkpoint_every=2"], tmp_path)  # fmt: skip
    dm = MixedRegressionDataModule(setting=None, sizes="12x6,4x20", probs=[0.5, 0.3, 0.2], dim=5, noise=0.1, seed=0)
    dm.setup()
    fed = dm.federated
    x, y, ptr = fed.train.x.numpy(), fed.train.y.numpy(), fed.train.ptr.numpy()
    theta = fed.extras["theta_star"].numpy()
    for _ in range(2):
        theta = np_fedx_round(x, y, ptr, theta, 0.05, 5)
    engine = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]["net.theta"]
    assert_close_finite(engine.numpy(), theta, atol=1e-12, rtol=0)
    with pytest.raises(ConfigError, match="cannot take"):
        cfg = ["configs/mixed_regression/c1.yaml", "configs/mixed_regression/oracle.yaml"]
        train_config(cfg, [*MR, "--model.network.init_args.num_clusters=2", "--trainer.max_steps=1"], tmp_path / "b")


def test_reproduction_runner_takes_a_custom_setting():
    from experiments import mixed_regression as mr

    out = mr.run_seed("custom", 0, 30, 0.05, 5, dim=5, noise=0.1, methods=("fedavg", "oracle"),
                      sizes="12x6,4x20", probs=[0.5, 0.3, 0.2])  # fmt: skip
    assert math.isfinite(out["fedavg"]["final"]) and out["oracle"]["final"] < 0.5 * out["fedavg"]["final"]
