"""Ditto (Li et al. 2021; ``fl_lightning/algorithms/ditto.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.algorithms import Ditto
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.body_head_scalar import LR, context, np_loss_grads, problem
from tests.helpers.functional_mlp import NAMES, HeavyBall, close, rand_params, ref_grad


# ---- Ditto --------------------------------------------------------------------------------------------------
def test_ditto_global_and_personal_steps(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    glob, v0, lam = rand_params(7), rand_params(8), 0.6
    alg = Ditto(lam=lam, local_epochs=2, personal_epochs=3)
    upd = alg.client_update(ctx(), glob, {"v." + n: v0[n] for n in NAMES})
    w, opt = dict(glob), HeavyBall()
    for _ in range(2):
        w = opt.step(w, ref_grad(w, x, y))
    v, opt = dict(v0), HeavyBall()  # a fresh optimiser for the personal model
    for _ in range(3):  # ∇(f(v) + λ/2‖v − w^t‖²), anchored at the received global model
        g = ref_grad(v, x, y)
        v = opt.step(v, {n: g[n] + lam * (v[n] - glob[n]) for n in NAMES})
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)
    close(alg.client_model(glob, upd.state), v)  # evaluated with the personal model


def test_ditto_defaults_and_lambda_edge() -> None:
    alg = Ditto()
    assert alg.lam == 0.75 and alg.local_epochs == 1 and alg.personal_epochs == 1
    assert Ditto(local_epochs=3).personal_epochs == 3 and Ditto(local_epochs=3, personal_epochs=2).personal_epochs == 2
    assert Ditto(lam=0.0).lam == 0.0
    with pytest.raises(ConfigError, match="lam"):
        Ditto(lam=-1e-9)


def test_ditto_reports_the_global_loss_and_steps_both_models() -> None:
    x, y, glob = problem()
    lam = 0.5
    v0_w, v0_h = np.array([1.0, 0.5]), 1.5
    state = {"v.body.weight": torch.tensor(v0_w[None, :]), "v.head.weight": torch.tensor([[v0_h]], dtype=torch.float64)}
    alg = Ditto(lam=lam)
    up = alg.client_update(context(x, y), glob, state)

    xn, yn, w0, h0 = x.numpy(), y.numpy(), glob["body.weight"].numpy()[0], float(glob["head.weight"])
    f_glob, gw, gh = np_loss_grads(xn, yn, w0, h0)
    _, pw, ph = np_loss_grads(xn, yn, v0_w, v0_h)
    assert_close_finite(float(up.loss), f_glob)
    assert_close_finite(up.upload["body.weight"], (w0 - LR * gw)[None, :])
    assert_close_finite(up.upload["head.weight"], [[h0 - LR * gh]])
    assert_close_finite(up.state["v.body.weight"], (v0_w - LR * (pw + lam * (v0_w - w0)))[None, :])
    assert_close_finite(up.state["v.head.weight"], [[v0_h - LR * (ph + lam * (v0_h - h0))]])
