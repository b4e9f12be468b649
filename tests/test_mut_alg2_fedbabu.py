"""FedBABU (Oh et al. 2022, Algorithm 1) on one client against numpy: one epoch of local SGD on the body through the
fixed head (the head is neither trained nor uploaded), the reported loss, the templates (body only), set-up's
check for a head, and one local epoch by default."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.algorithms import FedBABU
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel

D, N = 2, 4


def half_mse(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def problem() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.randn(N, generator=g, dtype=torch.float64)
    glob = {
        "body.weight": torch.tensor([[0.5, -0.25]], dtype=torch.float64),
        "head.weight": torch.tensor([[2.0]], dtype=torch.float64),
    }
    return x, y, glob


def test_defaults_and_setup_needs_a_head() -> None:
    assert FedBABU().local_epochs == 1
    _, _, glob = problem()
    FedBABU().setup(glob, 3)
    with pytest.raises(ConfigError, match="head"):
        FedBABU().setup({"body.weight": glob["body.weight"], "headless.w": torch.ones(1)}, 3)


def test_client_update_trains_the_body_through_the_fixed_head() -> None:
    x, y, glob = problem()
    lr = 0.3
    net = SplitModel(nn.Linear(D, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    opt = ClientOptimizer(lr=lr, momentum=0.9, batch_size=8)  # one batch: the first step is −lr·∇
    ctx = ClientContext(net, 0, x, y, None, opt, half_mse, make_generator(0, "babu"))
    alg = FedBABU()
    up = alg.client_update(ctx, glob, {})

    w, h = glob["body.weight"].numpy()[0], float(glob["head.weight"])
    r = h * (x.numpy() @ w) - y.numpy()
    grad_w = h * x.numpy().T @ r / N
    assert set(up.upload) == {"body.weight"}
    assert_close_finite(up.upload["body.weight"], (w - lr * grad_w)[None, :])
    assert_close_finite(float(up.loss), 0.5 * np.mean(r**2))
    assert up.state == {} and up.num_samples == N
    assert set(alg.upload_template(glob)) == {"body.weight"}
    assert set(alg.download_template(glob)) == {"body.weight"}
    assert alg.download_template(glob)["body.weight"] is glob["body.weight"]
