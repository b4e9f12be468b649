"""IFCA and FedX (Ghosh et al. 2020, spec 001; ``fl_lightning/algorithms/ifca.py``) against references written here:
its arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.algorithms.ifca import IFCA, refine
from fl_lightning.client import Params
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

K, D, N = 3, 2, 5


def problem() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)  # float32 data, float64 models
    theta = torch.tensor([[3.0, -3.0], [0.5, 1.0], [-2.0, 0.0]], dtype=torch.float64)
    y = (x.double() @ torch.tensor([0.6, 1.2], dtype=torch.float64)).float()  # nearest to cluster 1
    return x, y, {"theta": theta, "assign": torch.zeros(K, dtype=torch.float64)}


def context(x: Tensor, y: Tensor, round_idx: int = 0) -> ClientContext:
    return client_context(
        nn.Linear(1, 1), x, y, loss=nn.functional.mse_loss, generator=make_generator(0, "ifca"), round_idx=round_idx,
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


def choose(x: list[list[float]], y: list[float], theta: list[list[float]]) -> int:
    ctx = SimpleNamespace(x=torch.tensor(x, dtype=torch.float64), y=torch.tensor(y, dtype=torch.float64))
    return IFCA().choose_cluster(ctx, torch.tensor(theta, dtype=torch.float32))  # type: ignore[arg-type]


def test_choose_cluster_compares_float64_data_in_the_float32_models_dtype() -> None:
    theta = [[0.0], [3.0]]  # two 1-d models
    assert choose([[1.0], [1.0]], [0.5, 1.0], theta) == 0  # residuals 1.25 vs 10.25
    assert choose([[1.0], [1.0]], [2.0, 2.5], theta) == 1  # residuals 10.25 vs 1.25
    theta2 = [[1.0, 0.0], [0.0, 1.0]]  # 2-d models: y = x₁ or y = x₂
    assert choose([[2.0, 1.0], [0.5, -1.0]], [1.0, -1.0], theta2) == 1  # residuals 1 + 0 = 1 vs 0 + 0 = 0
    assert choose([[2.0, 1.0], [0.5, -1.0]], [2.0, 0.5], theta2) == 0  # residuals 0 vs 1 + 2.25
    # 1.5 + 1e-9 is 1.5 in float32: equally far (2.25) from both models, so the first; in float64 it is nearer 3
    assert np.float32(1.5 + 1e-9) == np.float32(1.5)
    assert choose([[1.0]], [1.5 + 1e-9], theta) == 0


def test_prox_refine_stays_in_the_datas_dtype_under_a_float64_default() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 2, generator=g)
    y = torch.randn(1, 4, generator=g)
    start = torch.randn(1, 2, generator=g)
    lr = 0.5
    xn, yn, sn = x[0].double().numpy(), y[0].double().numpy(), start[0].double().numpy()
    want = np.linalg.solve(np.eye(2) + lr / 4 * xn.T @ xn, sn + lr / 4 * xn.T @ yn)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = refine(x, y, start, lr, steps=3, solver="prox")
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == torch.float32
    assert_close_finite(got[0], want.astype(np.float32))


@pytest.mark.parametrize("d", [3, 1])
def test_ifca_prox_refine_is_the_closed_form_and_stays_on_the_inputs_device(d: int):
    """θ = (I + (η/n) XᵀX)⁻¹ (θ₀ + (η/n) Xᵀy) per client, in numpy (also with one feature: the result keeps its
    shape [clients, d]); then the same call on ``meta`` inputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    y = torch.randn(2, 5, generator=g, dtype=torch.float64)
    start = torch.randn(2, d, generator=g, dtype=torch.float64)
    lr, n = 0.3, 5
    want = np.stack([
        np.linalg.solve(np.eye(d) + lr / n * xb.T @ xb, sb + lr / n * xb.T @ yb)
        for xb, yb, sb in zip(x.numpy(), y.numpy(), start.numpy())
    ])  # fmt: skip
    got = refine(x, y, start, lr, steps=7, solver="prox")
    assert got.shape == (2, d)
    assert_close_finite(got, want)
    on_meta = refine(x.to("meta"), y.to("meta"), start.to("meta"), lr, steps=7, solver="prox")
    assert on_meta.device.type == "meta" and on_meta.shape == (2, d)
