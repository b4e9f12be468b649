"""One client with a linear model y ≈ Wx + b in float64: the data, its ``ClientContext`` and the numpy gradient, for
the FedDyn and Per-FedAvg client-update references."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for
from tests.helpers.clients import client_context
from tests.helpers.models import LinearRegressor

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
    return client_context(
        LinearRegressor(D, bias=True).double(), x, y, optimizer=opt, loss=loss_fn_for(None),
        generator=make_generator(0, "mut2"),
    )


def np_grad(x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """(½·mean r², ∂/∂w, ∂/∂b) of the linear model w·x + b."""
    r = x @ w.ravel() + b[0] - y
    return 0.5 * float(np.mean(r**2)), (x.T @ r / len(y))[None, :], np.array([r.mean()])
