"""L2GD's coin, aggregation step and ηλ range check (spec 000 §2.4/§8.2), and FedALA's evaluation model and
reported loss, against values written out here."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_finite
from torch import nn
from torch.nn import functional as F

from fl_lightning.algorithms import L2GD
from fl_lightning.algorithms.fedala import FedALA
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError

D = 3


class Counted(nn.Module):
    """A linear layer plus an integer buffer (like BatchNorm's ``num_batches_tracked``)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D, 1, dtype=torch.float64)
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(x)


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
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(), F.mse_loss, make_generator(1), round_idx=rnd, seed=seed)
    up = algo.client_update(ctx, glob, state)
    assert_close_finite(up.state["x.head.weight"], torch.full((1, D), 2.0), rtol=0, atol=1e-15)
    assert_close_finite(up.upload["delta_x.head.bias"], [-1.0], rtol=0, atol=1e-15)
    assert up.state["x.count"].dtype == torch.long and int(up.state["x.count"]) == 7
    assert "delta_x.count" not in up.upload


def ala_state(runs: int) -> dict[str, torch.Tensor]:
    return {"local.head.weight": torch.full((1, D), 4.0, dtype=torch.float64),
            "local.head.bias": torch.full((1,), 4.0, dtype=torch.float64),
            "ala_w.head.weight": torch.full((1, D), 0.25, dtype=torch.float64),
            "ala_w.head.bias": torch.full((1,), 0.25, dtype=torch.float64),
            "ala_runs": torch.tensor(runs)}  # fmt: skip


def test_fedala_client_model_global_before_the_first_run_mixed_after():
    glob = {"head.weight": torch.zeros(1, D, dtype=torch.float64), "head.bias": torch.zeros(1, dtype=torch.float64)}
    algo = FedALA()
    before = algo.client_model(glob, ala_state(0))
    assert float(before["head.weight"].abs().max()) == 0.0 and float(before["head.bias"].abs().max()) == 0.0
    after = algo.client_model(glob, ala_state(1))  # θ + (Θ − θ)·W = 4 − 4·0.25 = 3
    assert_close_finite(after["head.weight"], torch.full((1, D), 3.0), rtol=0, atol=1e-15)
    assert_close_finite(after["head.bias"], [3.0], rtol=0, atol=1e-15)


def test_fedala_first_round_reports_the_sgd_loss():
    """No local model yet: one full-batch SGD step from Θ; the reported loss is the MSE of Θ on the data."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, 1, generator=g, dtype=torch.float64)
    net = Counted()
    glob = {"head.weight": torch.randn(1, D, generator=g, dtype=torch.float64),
            "head.bias": torch.randn(1, generator=g, dtype=torch.float64), "count": torch.tensor(7)}  # fmt: skip
    algo = FedALA()
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(lr=0.1, momentum=0.0, batch_size=10), F.mse_loss,
                        make_generator(1))  # fmt: skip
    up = algo.client_update(ctx, glob, algo.init_client_state(glob))
    r = x @ glob["head.weight"].T + glob["head.bias"] - y
    assert float(up.loss) == pytest.approx(float((r**2).mean()), rel=1e-12)
    assert_close_finite(up.upload["head.weight"], glob["head.weight"] - 0.1 * 2 * (r.T @ x) / 4, rtol=1e-12, atol=1e-14)
