"""FedBN's constructor (FedAvg's one local epoch, a user's ``personal`` prefixes kept over the BN default), FedDyn
on one client against a numpy reference (the reported loss, the step on L_i − ⟨g_i, θ⟩ + α/2‖θ − θ^{t−1}‖², the
state update g_i ← g_i − α(θ_i − θ^{t−1})), its server state (kept when set-up runs again, stored in a checkpoint
as ``h__<name with dots as __>``, α = 0.01 by default), and Per-FedAvg's evaluation-time adaptation (a one-sample
client adapts; a client without samples keeps its parameters)."""

from __future__ import annotations

import numpy as np
import torch
from helpers import LinearRegressor, assert_close_finite
from torch import Tensor

from fl_lightning.algorithms import FedBN, FedDyn, PerFedAvg
from fl_lightning.client import ClientContext, ClientOptimizer, loss_fn_for
from fl_lightning.engine.rounds import make_generator

D = 3


def data(n: int) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    glob = {
        "fc.weight": torch.randn(1, D, generator=g, dtype=torch.float64),
        "fc.bias": torch.randn(1, generator=g, dtype=torch.float64),
    }
    return x, y, glob


def context(x: Tensor, y: Tensor, lr: float = 0.1, bs: int = 10) -> ClientContext:
    opt = ClientOptimizer(lr=lr, momentum=0.5, batch_size=bs)
    return ClientContext(
        LinearRegressor(D, bias=True).double(), 0, x, y, None, opt, loss_fn_for(None), make_generator(0, "mut2")
    )


def np_grad(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """(½·mean r², ∂/∂w, ∂/∂b) of the linear model w·x + b."""
    r = x @ w.ravel() + b[0] - y
    return 0.5 * float(np.mean(r**2)), (x.T @ r / len(y))[None, :], np.array([r.mean()])


# -- FedBN -------------------------------------------------------------------------------------------------------
def test_fedbn_defaults_to_one_local_epoch_and_keeps_given_personal_prefixes() -> None:
    assert FedBN().local_epochs == 1
    alg = FedBN(personal=["head."])
    assert alg.personal == ("head.",)
    params = {
        "body.bn1.weight": torch.ones(2),
        "body.bn1.running_mean": torch.zeros(2),
        "body.fc.weight": torch.ones(2, 2),
        "head.weight": torch.ones(1, 2),
    }
    alg.setup(params, 3)
    assert alg.personal == ("head.",)  # not replaced by the BN layers found
    assert alg.is_personal("head.weight") and not alg.is_personal("body.bn1.weight")
    default = FedBN()
    default.setup(params, 3)
    assert default.personal == ("body.bn1.",)


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


# -- Per-FedAvg --------------------------------------------------------------------------------------------------
def test_perfedavg_adapts_a_one_sample_client_and_keeps_an_empty_one() -> None:
    x, y, glob = data(1)
    alg = PerFedAvg(adapt_lr=0.2, adapt_steps=1)
    got = alg.adapt_for_evaluation(context(x, y), glob)
    w0, b0 = glob["fc.weight"].numpy(), glob["fc.bias"].numpy()
    _, dw, db = np_grad(x.numpy(), y.numpy(), w0, b0)
    assert_close_finite(got["fc.weight"], w0 - 0.2 * dw)
    assert_close_finite(got["fc.bias"], b0 - 0.2 * db)

    empty = alg.adapt_for_evaluation(context(x[:0], y[:0]), glob)
    assert_close_finite(empty["fc.weight"], w0)
    assert_close_finite(empty["fc.bias"], b0)
