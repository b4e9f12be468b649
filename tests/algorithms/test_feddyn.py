"""FedDyn (Acar et al. 2021; ``fl_lightning/algorithms/feddyn.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from fl_lightning.algorithms import FedDyn
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.linear_client import D, context, data, np_grad
from tests.helpers.models import LinearRegressor
from tests.helpers.round_references import (
    LR,
    MOMENTUM,
    Run,
    assert_matches,
    max_difference,
    mean_of,
    model_with,
    params_of,
)


# ---- FedDyn -----------------------------------------------------------------------------------------------------
def feddyn_client(template, theta, g, x, y, alpha, epochs, sign=-1.0):
    """argmin L_i(θ) − ⟨g_i, θ⟩ + α/2‖θ − θ^{t−1}‖² by SGD (``sign=+1``: the linear term's sign flipped)."""
    model = model_with(template, theta)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        loss = F.cross_entropy(model(x), y)
        for n, p in model.named_parameters():
            loss = loss + sign * (g[n] * p).sum() + alpha / 2 * ((p - theta[n]) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params_of(model)


def feddyn_reference(run, alpha, epochs, sign=-1.0):
    m = 4
    theta = dict(run.init)
    h = {n: torch.zeros_like(v) for n, v in theta.items()}
    g = {c: {n: torch.zeros_like(v) for n, v in theta.items()} for c in range(m)}
    for cohort in run.cohorts:
        local = {c: feddyn_client(run.template, theta, g[c], *run.data[c], alpha, epochs, sign) for c in cohort}
        for c in cohort:
            g[c] = {n: g[c][n] - alpha * (local[c][n] - theta[n]) for n in theta}
        h = {n: h[n] - alpha / m * sum(local[c][n] - theta[n] for c in cohort) for n in theta}
        mean = mean_of([local[c] for c in cohort])
        theta = {n: mean[n] - h[n] / alpha for n in theta}
    return theta, g, h


def test_feddyn_client_and_server_updates_match_the_reference_over_rounds():
    alpha, epochs = 0.1, 3
    run = Run(FedDyn(alpha=alpha, local_epochs=epochs))
    theta, g, h = feddyn_reference(run, alpha, epochs)
    assert max(float(v.abs().max()) for v in h.values()) > 1e-4  # the server state is in play
    assert_matches(run.global_params(), theta, theta)
    assert_matches(run.module.algorithm.server_state(), h, h)
    for c in range(4):
        assert_matches(run.bank("grad.", c), g[c], theta)
    flipped, _, _ = feddyn_reference(run, alpha, epochs, sign=+1.0)  # +⟨g_i, θ⟩ instead of −⟨g_i, θ⟩
    assert max_difference(run.global_params(), flipped) > 1e-4


# -- FedDyn ------------------------------------------------------------------------------------------------------
def feddyn(alpha: float, glob: dict[str, Tensor], clients: int = 4) -> FedDyn:
    alg = FedDyn(alpha=alpha)
    alg.check_compatible(LinearRegressor(D, bias=True), None)
    alg.setup(glob, clients)
    return alg


def test_feddyn_default_alpha_is_the_papers_001() -> None:
    assert FedDyn().alpha == 0.01


def test_feddyn_client_update_loss_step_and_state_against_numpy() -> None:
    """One epoch, one minibatch of all 4 samples: the reported loss is L_i(θ^{t−1}) − ⟨g_i, θ^{t−1}⟩ (the
    proximal term is 0 at the anchor); the first SGD step is −lr·(∇L_i − g_i)."""
    x, y, glob = data(4)
    alpha, lr = 0.3, 0.1
    alg = feddyn(alpha, glob)
    g_w, g_b = np.array([[0.5, -1.0, 0.25]]), np.array([0.75])
    state = {"grad.fc.weight": torch.tensor(g_w), "grad.fc.bias": torch.tensor(g_b)}
    up = alg.client_update(context(x, y, lr), glob, state)

    w0, b0 = glob["fc.weight"].numpy(), glob["fc.bias"].numpy()
    f0, dw, db = np_grad(x.numpy(), y.numpy(), w0, b0)
    want_loss = f0 - float((w0 * g_w).sum() + (b0 * g_b).sum())
    assert_close_finite(float(up.loss), want_loss)
    w1, b1 = w0 - lr * (dw - g_w), b0 - lr * (db - g_b)
    assert_close_finite(up.upload["delta.fc.weight"], w1 - w0)
    assert_close_finite(up.upload["delta.fc.bias"], b1 - b0)
    assert_close_finite(up.state["grad.fc.weight"], g_w - alpha * (w1 - w0))
    assert_close_finite(up.state["grad.fc.bias"], g_b - alpha * (b1 - b0))


def test_feddyn_setup_again_keeps_the_server_state() -> None:
    _, _, glob = data(1)
    alg = feddyn(0.1, glob)
    alg.server_state()["fc.weight"].fill_(2.5)
    alg.setup(glob, 4)  # e.g. set-up after restoring h from a checkpoint
    assert_close_finite(alg.server_state()["fc.weight"], np.full((1, D), 2.5))
    assert_close_finite(alg.server_state()["fc.bias"], np.zeros(1))


def test_feddyn_checkpoint_names_h_after_the_parameter() -> None:
    """h of ``fc.weight`` is the buffer ``h__fc__weight`` (dots are not allowed in a buffer name): the key a saved
    checkpoint holds, so a checkpoint of an earlier run restores it."""
    _, _, glob = data(1)
    alg = feddyn(0.1, glob)
    assert set(alg.state_dict()) == {"h__fc__weight", "h__fc__bias"}
    saved = {"h__fc__weight": torch.tensor([[1.0, 2.0, 3.0]]), "h__fc__bias": torch.tensor([-4.0])}
    alg.load_state_dict(saved)
    assert_close_finite(alg.server_state()["fc.weight"], np.array([[1.0, 2.0, 3.0]]))
    assert_close_finite(alg.server_state()["fc.bias"], np.array([-4.0]))


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
