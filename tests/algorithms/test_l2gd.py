"""L2GD (Hanzely & Richtárik 2020, spec 000 §2.4; ``fl_lightning/algorithms/l2gd.py``) against references written here:
its arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.algorithms import L2GD
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite, assert_params_close_finite
from tests.helpers.clients import client_context
from tests.helpers.counted_model import Counted, D
from tests.helpers.functional_mlp import LR, NAMES, close, rand_params, ref_grad
from tests.helpers.split_models import NAMES as NAMES_2
from tests.helpers.split_models import far, reference_sgd
from tests.helpers.split_models import rand_params as rand_params_2


# ---- L2GD ---------------------------------------------------------------------------------------------------
def test_l2gd_branches_and_expected_update(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    xbar, x0 = rand_params(11), rand_params(12)
    p, alpha, lam, n_clients = 0.9, 0.25, 1.0, 10
    alg = L2GD(p=p, alpha=alpha, lam=lam, local_epochs=1)
    alg.setup(xbar, n_clients)
    a = alpha * lam / (n_clients * (1 - p))  # ηλ with η = α/(N(1−p))
    state = {"x." + n: x0[n] for n in NAMES}
    g = ref_grad(x0, x, y)
    local = {n: x0[n] - LR * g[n] for n in NAMES}
    pulled = {n: (1 - a) * x0[n] + a * xbar[n] for n in NAMES}

    rounds, coins, total = 1000, 0, {n: torch.zeros_like(x0[n]) for n in NAMES}
    for r in range(rounds):
        upd = alg.client_update(ctx(round_idx=r), xbar, state)
        new = {n: upd.state["x." + n] for n in NAMES}
        agg = alg.aggregation_round(0, r)
        close(new, pulled if agg else local)
        close({n: upd.upload["delta_x." + n] for n in NAMES}, {n: new[n] - x0[n] for n in NAMES})
        coins += agg
        total = {n: total[n] + new[n] for n in NAMES}
    assert abs(coins / rounds - p) < 4 * math.sqrt(p * (1 - p) / rounds)
    expected = {n: (1 - p) * local[n] + p * pulled[n] for n in NAMES}  # E over the round's coin
    spread = max(float((local[n] - pulled[n]).abs().max()) for n in NAMES)
    for n in NAMES:
        err = (total[n] / rounds - expected[n]).abs().max()
        assert err <= 4 * spread * math.sqrt(p * (1 - p) / rounds), n


def test_l2gd_p_must_be_strictly_inside_0_1_and_defaults():
    L2GD(p=1e-6)
    L2GD(p=1 - 1e-6)
    for p in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError):
            L2GD(p=p)
    algo = L2GD()
    assert (algo.p, algo.alpha, algo.lam, algo.local_epochs) == (0.9, 0.25, 1.0, 1)  # spec 000 §8.2
    assert algo.num_clients == 0  # nothing set up yet


def coin(seed: int, rnd: int) -> float:
    return float(torch.rand((), generator=make_generator(seed, "l2gd", rnd)))


def test_l2gd_coin_is_drawn_from_the_l2gd_stream_and_is_strict():
    algo = L2GD(p=0.5)
    got = [algo.aggregation_round(seed, r) for seed in (0, 3) for r in range(12)]
    assert got == [coin(seed, r) < 0.5 for seed in (0, 3) for r in range(12)]
    u = coin(1, 4)
    assert not L2GD(p=u).aggregation_round(1, 4)  # ξ = 1 iff the uniform draw is < p
    assert L2GD(p=min(u * 1.01, 0.999)).aggregation_round(1, 4)


@pytest.mark.parametrize(
    ("alpha", "p", "clients", "ok"), [(0.0, 0.9, 2, True), (0.5, 0.5, 1, True), (0.75, 0.5, 1, False)]
)
def test_l2gd_mixing_must_lie_in_0_1(alpha, p, clients, ok):
    """ηλ = αλ/(N(1−p)): 0 and exactly 1 are accepted, 1.5 is refused."""
    algo = L2GD(p=p, alpha=alpha, lam=1.0)
    if ok:
        algo.setup({}, clients)
        assert algo.mixing == alpha / (clients * (1 - p))
    else:
        with pytest.raises(ConfigError):
            algo.setup({}, clients)


def test_l2gd_aggregation_step_mixes_floats_and_keeps_integer_buffers():
    """An aggregation round: x_i ← (1 − ηλ)x_i + ηλ x̄ for floating tensors; the integer buffer is kept as it is."""
    seed, rnd = 0, next(r for r in range(50) if coin(0, r) < 0.99)
    algo = L2GD(p=0.99, alpha=0.25, lam=1.0)
    algo.setup({}, 50)  # ηλ = 0.25 / (50 · 0.01) = 0.5
    net = Counted()
    glob = {"head.weight": torch.ones(1, D, dtype=torch.float64), "head.bias": torch.zeros(1, dtype=torch.float64),
            "count": torch.tensor(7)}  # fmt: skip
    state = {"x.head.weight": torch.full((1, D), 3.0, dtype=torch.float64),
             "x.head.bias": torch.full((1,), 2.0, dtype=torch.float64), "x.count": torch.tensor(7)}  # fmt: skip
    x, y = torch.zeros(2, D, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)
    ctx = client_context(net, x, y, loss=F.mse_loss, generator=make_generator(1), round_idx=rnd, seed=seed)
    up = algo.client_update(ctx, glob, state)
    assert_close_finite(up.state["x.head.weight"], torch.full((1, D), 2.0), rtol=0, atol=1e-15)
    assert_close_finite(up.upload["delta_x.head.bias"], [-1.0], rtol=0, atol=1e-15)
    assert up.state["x.count"].dtype == torch.long and int(up.state["x.count"]) == 7
    assert "delta_x.count" not in up.upload


def test_l2gd_local_step_from_own_model_and_pull_towards_the_mean(client):
    """L2GD (spec 000 §2.4): a local round trains x_i (not x̄); an aggregation round moves x_i ← (1 − ηλ)x_i + ηλx̄
    (towards the mean, not away, not the roles of x_i and x̄ swapped); Δx_i = new − old is uploaded. The coin
    is one per round, the same for every client."""
    ctx, x, y = client
    xbar, xi = rand_params_2(10), rand_params_2(11)
    alg = L2GD(p=0.5, alpha=0.2, lam=1.0, local_epochs=2)
    alg.setup(xbar, num_clients=4)
    a = 0.2 * 1.0 / (4 * (1 - 0.5))  # ηλ with η = α/(N(1−p))
    state = {"x." + n: xi[n] for n in NAMES_2}
    coins = [alg.aggregation_round(0, r) for r in range(40)]
    assert 5 < sum(coins) < 35
    for r in (coins.index(True), coins.index(False)):
        c = ctx()
        c.round = r
        upd = alg.client_update(c, xbar, state)
        new = {n: upd.state["x." + n] for n in NAMES_2}
        want = {n: (1 - a) * xi[n] + a * xbar[n] for n in NAMES_2} if coins[r] else reference_sgd(xi, x, y, NAMES_2, 2)
        assert_params_close_finite(new, want, rtol=1e-9, atol=1e-10)
        if coins[r]:  # x_i and x̄ swapped; pushed away from x̄
            assert far(new, {n: (1 - a) * xbar[n] + a * xi[n] for n in NAMES_2})
            assert far(new, {n: (1 + a) * xi[n] - a * xbar[n] for n in NAMES_2})
        else:  # trained from x̄ instead of x_i
            assert far(new, reference_sgd(xbar, x, y, NAMES_2, 2))
        delta = {n: upd.upload["delta_x." + n] for n in NAMES_2}
        assert_params_close_finite(delta, {n: want[n] - xi[n] for n in NAMES_2}, rtol=1e-9, atol=1e-10)
        other = ctx()
        other.client, other.round = 3, r  # another client in the same round takes the same branch
        assert_params_close_finite({n: alg.client_update(other, xbar, state).state["x." + n] for n in NAMES_2}, want)
