"""Fed-MTL (Smith et al. 2017 as in the LG-FedAvg code; ``fl_lightning/algorithms/fedmtl.py``) against references
written here: its arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.algorithms import L2GD, FedMTL
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.algorithms.fedmtl import code_scale
from tests.helpers.asserts import assert_close_finite, assert_params_close_finite
from tests.helpers.functional_mlp import LR, NAMES, close, rand_params, ref_grad
from tests.helpers.split_models import NAMES as NAMES_2
from tests.helpers.split_models import cifar_params, far, reference_sgd
from tests.helpers.split_models import rand_params as rand_params_2


# ---- Fed-MTL ------------------------------------------------------------------------------------------------
def test_fedmtl_regulariser_gradient_matches_trace_form(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    n_clients, j = 5, 2
    models = [rand_params(20 + i) for i in range(n_clients)]
    alg = FedMTL(local_epochs=1, reg_scale=0.01)
    alg.setup(models[0], n_clients)
    mean = {n: sum(m[n] for m in models) / n_clients for n in NAMES}

    # reference: s·(‖W‖² + tr(WΩWᵀ)) with W = [w_1 … w_N], Ω = (I − 11ᵀ/N)², gradient in client j's column
    cols = [torch.cat([m[n].reshape(-1) for n in NAMES]) for m in models]
    wj = cols[j].clone().requires_grad_(True)
    W = torch.stack([wj if i == j else c for i, c in enumerate(cols)], dim=1)
    center = torch.eye(n_clients, dtype=W.dtype) - torch.ones(n_clients, n_clients, dtype=W.dtype) / n_clients
    omega = center @ center
    reg = 0.01 * (W.pow(2).sum() + torch.trace(W @ omega @ W.T))
    (want,) = torch.autograd.grad(reg, wj)

    leaves = {n: models[j][n].clone().requires_grad_(True) for n in NAMES}
    penalty = alg.regulariser(mean, NAMES)(leaves)
    got = torch.cat([g.reshape(-1) for g in torch.autograd.grad(penalty, [leaves[n] for n in NAMES])])
    assert_close_finite(got, want)

    # the client step: full-batch SGD on f + that regulariser, starting from its own model
    upd = alg.client_update(ctx(), mean, {"w." + n: models[j][n] for n in NAMES})
    g = ref_grad(models[j], x, y)
    step = {n: models[j][n] - LR * (g[n] + 0.01 * (2 * models[j][n] + 2 * (models[j][n] - mean[n]))) for n in NAMES}
    close({n: upd.state["w." + n] for n in NAMES}, step)


@pytest.mark.parametrize("dim", [1, 9, 10, 99, 100, 999, 1000, 12345, 99999, 100000])
def test_code_scale_is_ten_to_minus_digits_plus_one(dim):
    assert code_scale(dim) == pytest.approx(10.0 ** -(len(str(dim)) + 1), rel=1e-12)


def test_fedmtl_setup_counts_only_floating_point_tensors():
    glob = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)}
    glob["steps"] = torch.zeros(5000, dtype=torch.long)
    alg = FedMTL()
    alg.setup(glob, num_clients=6)
    assert alg.num_clients == 6
    assert alg.scale == pytest.approx(1e-3, rel=1e-12)  # dim W = 17: two digits
    alg = FedMTL(reg_scale=0.25)
    alg.setup(glob, num_clients=6)
    assert alg.scale == 0.25


def test_fedmtl_defaults():
    alg = FedMTL()
    assert (alg.local_epochs, alg.reg_scale) == (1, None)


@pytest.mark.parametrize("cls, local, delta", [(L2GD, "x.", "delta_x."), (FedMTL, "w.", "delta_w.")])
def test_full_local_model_methods_keep_the_model_and_upload_only_deltas(cls, local, delta):
    """L2GD and Fed-MTL: every client keeps a whole model x_i / w_i; it uploads Δ only, never a parameter."""
    params = cifar_params()
    algorithm = cls()
    algorithm.setup(params, num_clients=10)
    assert list(algorithm.init_client_state(params)) == [local + n for n in params]
    assert list(algorithm.upload_template(params)) == [delta + n for n in params]
    state = {local + n: torch.full_like(t, float(i)) for i, (n, t) in enumerate(params.items())}
    model = algorithm.client_model(params, state)
    assert all(torch.equal(model[n], state[local + n]) for n in params)  # evaluated with its own model


@pytest.mark.parametrize("cls, local, delta", [(L2GD, "x.", "delta_x."), (FedMTL, "w.", "delta_w.")])
def test_server_keeps_the_population_mean_from_deltas(client, cls, local, delta):
    """x̄ ← x̄ + (|S|/N)·mean_S Δx_i: after |S| = 2 client updates of N = 8 clients, the mean moves by a quarter
    of the cohort's mean delta (the six other clients did not move), in the delta's direction."""
    ctx, _, _ = client
    glob = rand_params_2(14)
    alg = cls()
    alg.setup(glob, num_clients=8)
    for _ in range(2):  # this round's cohort
        alg.client_update(ctx(), glob, {local + n: glob[n] for n in NAMES_2})
    avg = {delta + n: torch.full_like(glob[n], 0.5) * (i + 1) for i, n in enumerate(NAMES_2)}
    live = {n: t.clone() for n, t in glob.items()}
    alg.server_update(live, avg, RoundFacts(0, num_aggregated=2))
    want = {n: glob[n] + 2 / 8 * 0.5 * (i + 1) for i, n in enumerate(NAMES_2)}
    assert_params_close_finite(live, want, rtol=0, atol=1e-12)


def test_fedmtl_step_from_own_model_anchored_at_the_mean(client):
    """Fed-MTL: SGD on f_i(w) + s(‖w‖² + ‖w − w̄‖²) from the client's own w_i with the mean w̄ held fixed; the
    regulariser pulls towards w̄ (its sign), and w_i and w̄ are not swapped."""
    ctx, x, y = client
    mean, wi = rand_params_2(12), rand_params_2(13)
    s = 0.05
    alg = FedMTL(local_epochs=3, reg_scale=s)
    alg.setup(mean, num_clients=5)
    upd = alg.client_update(ctx(), mean, {"w." + n: wi[n] for n in NAMES_2})

    def reg(anchor, sign=1.0):
        return lambda p: s * sum((p[n] ** 2).sum() + sign * ((p[n] - anchor[n]) ** 2).sum() for n in NAMES_2)

    want = reference_sgd(wi, x, y, NAMES_2, 3, penalty=reg(mean))
    new = {n: upd.state["w." + n] for n in NAMES_2}
    assert_params_close_finite(new, want, rtol=1e-9, atol=1e-10)
    assert far(new, reference_sgd(mean, x, y, NAMES_2, 3, penalty=reg(wi)))  # roles of w_i and w̄ swapped
    assert far(new, reference_sgd(wi, x, y, NAMES_2, 3, penalty=reg(mean, -1.0)), gap=1e-4)  # pushed away


def test_fedmtl_declares_its_regulariser_gradient_in_closed_form():
    """The regulariser's closed-form gradient is autograd's gradient of s·(‖w‖² + ‖w − w̄‖²) written here."""
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(3, generator=g, dtype=torch.float64) for n in ("a", "b")}
    mean = {n: torch.randn(3, generator=g, dtype=torch.float64) for n in ("a", "b")}
    algo = FedMTL(reg_scale=0.03)
    algo.setup(w, 5)
    leaves = {n: v.clone().requires_grad_(True) for n, v in w.items()}
    value = 0.03 * sum((leaves[n] ** 2).sum() + ((leaves[n] - mean[n]) ** 2).sum() for n in leaves)
    expected = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    penalty = algo.regulariser(mean, ["a", "b"])
    got = penalty.gradient(w, penalty.data)
    assert set(got) == {"a", "b"}
    for n in w:
        assert_close_finite(got[n], expected[n], rtol=1e-12, atol=1e-14)
    assert abs(float(penalty.fn(w, penalty.data)) - float(value)) < 1e-12
