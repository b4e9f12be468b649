"""Ditto (Li et al. 2021) and FedRep (Collins et al. 2021) on one client against numpy, for y ≈ h·⟨w, x⟩ (body w,
head h) with one minibatch of all samples, so each phase's first momentum-SGD step is −lr·∇ and its loss is the
objective where the phase starts. Ditto: the reported loss is the global model's, the personal phase's loss
(λ/2‖v − w^t‖² included) is the ``personal_loss`` metric; defaults and λ ≥ 0 with its edge. FedRep: the head phase,
then the body phase through the new head, whose loss is reported."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.algorithms import Ditto, FedRep
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel

D, N, LR = 2, 4, 0.3


def half_mse(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def problem() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.randn(N, generator=g, dtype=torch.float64)
    glob = {
        "body.weight": torch.tensor([[0.5, -0.25]], dtype=torch.float64),
        "head.weight": torch.tensor([[2.0]], dtype=torch.float64),
    }
    return x, y, glob


def context(x: Tensor, y: Tensor) -> ClientContext:
    net = SplitModel(nn.Linear(D, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    opt = ClientOptimizer(lr=LR, momentum=0.9, batch_size=8)
    return ClientContext(net, 0, x, y, None, opt, half_mse, make_generator(0, "dr"))


def np_loss_grads(x: np.ndarray, y: np.ndarray, w: np.ndarray, h: float) -> tuple[float, np.ndarray, float]:
    """(½·mean r², ∂/∂w, ∂/∂h) with r = h⟨w, x⟩ − y."""
    r = h * (x @ w) - y
    return 0.5 * float(np.mean(r**2)), h * x.T @ r / len(y), float(np.mean(r * (x @ w)))


def test_ditto_defaults_and_lambda_edge() -> None:
    alg = Ditto()
    assert alg.lam == 0.75 and alg.local_epochs == 1 and alg.personal_epochs == 1
    assert Ditto(local_epochs=3).personal_epochs == 3 and Ditto(local_epochs=3, personal_epochs=2).personal_epochs == 2
    assert Ditto(lam=0.0).lam == 0.0
    with pytest.raises(ConfigError, match="lam"):
        Ditto(lam=-1e-9)


def test_ditto_reports_the_global_loss_and_the_personal_loss_metric() -> None:
    x, y, glob = problem()
    lam = 0.5
    v0_w, v0_h = np.array([1.0, 0.5]), 1.5
    state = {"v.body.weight": torch.tensor(v0_w[None, :]), "v.head.weight": torch.tensor([[v0_h]], dtype=torch.float64)}
    alg = Ditto(lam=lam)
    up = alg.client_update(context(x, y), glob, state)

    xn, yn, w0, h0 = x.numpy(), y.numpy(), glob["body.weight"].numpy()[0], float(glob["head.weight"])
    f_glob, gw, gh = np_loss_grads(xn, yn, w0, h0)
    f_pers, pw, ph = np_loss_grads(xn, yn, v0_w, v0_h)
    prox = 0.5 * lam * (((v0_w - w0) ** 2).sum() + (v0_h - h0) ** 2)
    assert_close_finite(float(up.loss), f_glob)
    assert set(up.metrics) == {"personal_loss"}
    assert_close_finite(float(up.metrics["personal_loss"]), f_pers + prox)
    assert_close_finite(up.upload["body.weight"], (w0 - LR * gw)[None, :])
    assert_close_finite(up.upload["head.weight"], [[h0 - LR * gh]])
    assert_close_finite(up.state["v.body.weight"], (v0_w - LR * (pw + lam * (v0_w - w0)))[None, :])
    assert_close_finite(up.state["v.head.weight"], [[v0_h - LR * (ph + lam * (v0_h - h0))]])


def test_fedrep_head_phase_then_body_phase_and_reports_the_body_phase_loss() -> None:
    x, y, glob = problem()
    alg = FedRep(head_epochs=1, body_epochs=1)
    h_own = 1.25
    up = alg.client_update(context(x, y), glob, {"head.weight": torch.tensor([[h_own]], dtype=torch.float64)})

    xn, yn, w0 = x.numpy(), y.numpy(), glob["body.weight"].numpy()[0]
    _, _, gh = np_loss_grads(xn, yn, w0, h_own)
    h1 = h_own - LR * gh
    f_body, gw, _ = np_loss_grads(xn, yn, w0, h1)
    assert_close_finite(float(up.loss), f_body)
    assert set(up.upload) == {"body.weight"}
    assert_close_finite(up.upload["body.weight"], (w0 - LR * gw)[None, :])
    assert_close_finite(up.state["head.weight"], [[h1]])
