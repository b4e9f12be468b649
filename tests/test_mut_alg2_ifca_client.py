"""IFCA's client update on one client against numpy (spec 001 §2.3 and eq. 8): the cluster of least squared
residual, ``local_steps`` GD steps θ ← θ − (η/n)Xᵀ(Xθ − y) on that row only (or the prox closed form), the one-hot
assignment and the label as state, the loss ½·mean(y − Xθ_z)² before the update; the warm-up rounds of a
subclass; the templates and ``complete`` (unused keys filled with zeros, theta with its unchanged value)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.client import ClientContext, ClientOptimizer, Params
from fl_lightning.engine.rounds import make_generator

K, D, N = 3, 2, 5


def problem() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)  # float32 data, float64 models
    theta = torch.tensor([[3.0, -3.0], [0.5, 1.0], [-2.0, 0.0]], dtype=torch.float64)
    y = (x.double() @ torch.tensor([0.6, 1.2], dtype=torch.float64)).float()  # nearest to cluster 1
    return x, y, {"theta": theta, "assign": torch.zeros(K, dtype=torch.float64)}


def context(x: Tensor, y: Tensor, round_idx: int = 0) -> ClientContext:
    return ClientContext(
        nn.Linear(1, 1), 0, x, y, None, ClientOptimizer(), nn.functional.mse_loss, make_generator(0, "ifca"),
        round_idx=round_idx,
    )


def np_cluster(x: np.ndarray, y: np.ndarray, theta: np.ndarray) -> int:
    return int(np.argmin(((y[:, None] - x @ theta.T) ** 2).sum(0)))


@pytest.mark.parametrize("solver", ["gd", "prox"])
def test_client_update_moves_only_the_chosen_row(solver: str) -> None:
    x, y, glob = problem()
    lr, steps = 0.3, 3
    alg = IFCA(local_steps=steps, lr=lr, solver=solver)  # type: ignore[arg-type]
    up = alg.client_update(context(x, y), glob, alg.init_client_state(glob))

    xn, yn, th = x.double().numpy(), y.double().numpy(), glob["theta"].numpy()
    z = np_cluster(xn, yn, th)
    assert z == 1
    if solver == "gd":
        row = th[z].copy()
        for _ in range(steps):
            row = row - lr / N * xn.T @ (xn @ row - yn)
    else:
        row = np.linalg.solve(np.eye(D) + lr / N * xn.T @ xn, th[z] + lr / N * xn.T @ yn)
    want = th.copy()
    want[z] = row
    assert set(up.upload) == {"theta"}
    assert_close_finite(up.upload["theta"], want)
    assert up.upload["theta"].dtype == torch.float64
    assert_close_finite(glob["theta"], th)  # the global theta itself is not modified
    assert_close_finite(up.state["assign"], np.eye(K)[z])
    assert_close_finite(up.state["label"], float(z))
    assert up.state["label"].dtype == torch.float64
    assert_close_finite(up.loss, 0.5 * np.mean((yn - xn @ th[z]) ** 2))
    assert up.num_samples == N


def test_init_client_state_is_the_assignment_and_no_label() -> None:
    _, _, glob = problem()
    state = IFCA().init_client_state(glob)
    assert set(state) == {"assign", "label"}
    assert state["assign"] is glob["assign"]
    assert state["label"].dtype == torch.float64 and float(state["label"]) == -1.0


class Warm(IFCA):
    """One warm-up round that uploads a marker, and one extra upload key."""

    warmup_rounds = 1

    def extra_uploads(self, global_params: Params) -> Params:
        return {"extra": torch.ones_like(global_params["assign"])}

    def warmup_update(self, ctx: ClientContext, global_params: Params, state: Params) -> ClientUpdate:
        upload = {"extra": global_params["assign"] + 7.0}
        return ClientUpdate(upload, {"assign": state["assign"] + 1.0}, ctx.num_samples, -1.0)


def test_warmup_rounds_come_first_then_clustered_rounds() -> None:
    x, y, glob = problem()
    alg = Warm(local_steps=1, lr=0.1)
    first = alg.client_update(context(x, y, round_idx=0), glob, alg.init_client_state(glob))
    assert first.loss == -1.0 and set(first.upload) == {"extra"}
    assert_close_finite(first.upload["extra"], np.full(K, 7.0))  # from the global parameters and the state
    assert_close_finite(first.state["assign"], np.ones(K))
    later = alg.client_update(context(x, y, round_idx=1), glob, alg.init_client_state(glob))
    assert set(later.upload) == {"theta", "extra"}
    assert_close_finite(later.upload["extra"], np.zeros(K))  # Phase 2 fills the warm-up key with zeros
    assert later.loss >= 0.0


def test_templates_and_complete() -> None:
    _, _, glob = problem()
    alg = Warm()
    assert set(alg.upload_template(glob)) == {"theta", "extra"}
    assert alg.upload_template(glob)["theta"] is glob["theta"]
    assert set(alg.download_template(glob)) == {"theta"}
    assert alg.download_template(glob)["theta"] is glob["theta"]
    assert set(IFCA().upload_template(glob)) == {"theta"}
    assert_close_finite(alg.upload_template(glob)["extra"], np.ones(K))
    out = alg.complete({"extra": torch.full((K,), 2.0)}, glob)
    assert set(out) == {"theta", "extra"}
    assert_close_finite(out["theta"], glob["theta"].numpy())
    assert_close_finite(out["extra"], np.full(K, 2.0))
    only = alg.complete({"theta": glob["theta"] * 2}, glob)
    assert_close_finite(only["theta"], 2 * glob["theta"].numpy())
    assert_close_finite(only["extra"], np.zeros(K))
