"""``fl_lightning/models/linear.py``: ``y = wᵀ Bᵀ x`` with B orthonormal at the start (spec 000 §2.2)."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.errors import ConfigError
from fl_lightning.models import LinearRepresentation


def test_representation_starts_orthonormal_and_the_output_is_w_b_x() -> None:
    torch.manual_seed(0)
    net = LinearRepresentation(dim=6, rank=2)
    b = net.representation
    assert b.shape == (6, 2)
    torch.testing.assert_close(b.T @ b, torch.eye(2), atol=1e-5, rtol=0)
    x = torch.randn(5, 6)
    w = net.head.weight[0]
    torch.testing.assert_close(net(x), (x @ b) @ w)
    assert net(x).shape == (5,)
    assert [n for n, _ in net.named_parameters()] == ["body.weight", "head.weight"]  # no biases


def test_sizes_come_from_the_data_and_are_required() -> None:
    assert LinearRepresentation.data_sizes == {"dim": "dim", "rank": "rank"}
    with pytest.raises(ConfigError, match="dim and rank are needed"):
        LinearRepresentation(dim=4)
