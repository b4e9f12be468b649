"""One client for y ≈ h·⟨w, x⟩ (body w, head h) in float64: the data, its ``ClientContext`` and the numpy loss and
gradients, for the Ditto and FedRep client-update references."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.models.split import SplitModel
from tests.helpers.clients import client_context

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
    return client_context(net, x, y, optimizer=opt, loss=half_mse, generator=make_generator(0, "dr"))


def np_loss_grads(x: np.ndarray, y: np.ndarray, w: np.ndarray, h: float) -> tuple[float, np.ndarray, float]:
    """(½·mean r², ∂/∂w, ∂/∂h) with r = h⟨w, x⟩ − y."""
    r = h * (x @ w) - y
    return 0.5 * float(np.mean(r**2)), h * x.T @ r / len(y), float(np.mean(r * (x @ w)))
