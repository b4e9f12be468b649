"""``Algorithm.predict`` (the network's forward with the given parameters, the side information passed on, the
module's own tensors used for names left out), ``upload_shared``'s default loss, and IFCA's constructor
(documented defaults, ``local_steps ≥ 1`` and ``lr > 0`` with their edges)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.algorithms import FedAvg, FedPer
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.errors import ConfigError


class _SideNet(nn.Module):
    """``(x W^T + b) · scale + side``: a linear layer, a buffer, and the side information when given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("scale", torch.tensor(3.0, dtype=torch.float64))

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        out = self.lin(x) * self.scale
        return out if side is None else out + side


def test_predict_uses_given_parameters_module_buffers_and_side() -> None:
    net = _SideNet().double()
    w = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    b = torch.tensor([0.5], dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    side = torch.tensor([[10.0], [20.0]], dtype=torch.float64)
    params = {"lin.weight": w, "lin.bias": b}  # the buffer "scale" is left out: the module's own is used
    want = (x.numpy() @ w.numpy().T + b.numpy()) * 3.0 + side.numpy()  # [[-7.5+10], [16.5+20]]
    got = FedAvg().predict(net, params, x, side)
    assert_close_finite(got, want)
    assert_close_finite(got, np.array([[2.5], [36.5]]))
    no_side = FedAvg().predict(net, params, x, None)
    assert_close_finite(no_side, np.array([[-7.5], [16.5]]))


def test_upload_shared_default_loss_is_zero() -> None:
    alg = FedPer()
    params = {"body.w": torch.ones(2), "head.w": torch.zeros(2)}
    ctx = SimpleNamespace(num_samples=7)
    update = alg.upload_shared(params, ctx, {"head.w": torch.ones(2)})  # type: ignore[arg-type]
    assert update.loss == 0.0
    assert update.num_samples == 7
    assert list(update.upload) == ["body.w"] and list(update.state) == ["head.w"]
    assert torch.equal(update.state["head.w"], torch.zeros(2))


def test_ifca_defaults() -> None:
    alg = IFCA()
    assert alg.local_steps == 5 and alg.lr == 0.05 and alg.solver == "gd"


def test_ifca_argument_edges() -> None:
    assert IFCA(local_steps=1).local_steps == 1
    assert IFCA(lr=1e-9).lr == 1e-9
    for kw in ({"local_steps": 0}, {"local_steps": -1}, {"lr": 0.0}, {"lr": -0.1}, {"local_steps": 0, "lr": 0.05}):
        with pytest.raises(ConfigError, match="local_steps"):
            IFCA(**kw)
