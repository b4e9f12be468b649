"""IFCA's cluster choice in the model's dtype (eq. 8: argmin_j ‖y − Xθ_j‖², the client's data cast to θ's dtype,
the first of equal residuals), the prox refinement's closed form in the data's dtype whatever torch's default
dtype, and FedDyn's constructor (α > 0 with its edge, one local epoch, nothing known before set-up)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import assert_close_finite

from fl_lightning.algorithms import FedDyn
from fl_lightning.algorithms.ifca import IFCA, refine
from fl_lightning.errors import ConfigError


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


def test_feddyn_alpha_must_be_positive_and_one_local_epoch_by_default() -> None:
    assert FedDyn(alpha=1e-12).alpha == 1e-12
    for alpha in (0.0, -0.1):
        with pytest.raises(ConfigError, match="alpha"):
            FedDyn(alpha=alpha)
    assert FedDyn().local_epochs == 1


def test_feddyn_before_setup_knows_no_clients_and_no_parameters() -> None:
    alg = FedDyn()
    assert alg.num_clients == 0
    assert alg.names == [] and alg.buffer_names == frozenset()
    assert alg.server_state() == {}
    assert alg.init_client_state({"w": torch.ones(2)}) == {}
    alg.setup({"w": torch.ones(2), "b": torch.ones(1)}, 3)  # no check_compatible: no buffers known
    assert alg.names == ["w", "b"] and alg.num_clients == 3
