"""``fl_lightning/models/regression.py``: k cluster linear models with a one-hot choice (spec 001) and the low-rank
factors ``U Vᵀ`` (spec 003), against the formulas written out here."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.errors import ConfigError
from fl_lightning.models import ClusteredLinear, LowRankFactors


def test_clustered_linear_predicts_with_the_chosen_clusters_model() -> None:
    net = ClusteredLinear(num_clusters=3, dim=4, seed=5)
    g = torch.Generator().manual_seed(5)
    torch.testing.assert_close(net.theta.data, 0.5 * torch.randn(3, 4, generator=g, dtype=torch.float64))  # 1/√4
    assert net.assign.tolist() == [1.0, 0.0, 0.0]
    x = torch.randn(7, 4)
    net.assign.copy_(torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(net(x), x.double() @ net.theta.data[2])
    assert ClusteredLinear(num_clusters=2, dim=4, init_scale=0.0).theta.abs().sum() == 0


def test_clustered_linear_refuses_a_missing_dimension() -> None:
    with pytest.raises(ConfigError, match="need dim ≥ 1"):
        ClusteredLinear(num_clusters=2, dim=None)
    with pytest.raises(ConfigError, match="num_clusters=0"):
        ClusteredLinear(num_clusters=0, dim=3)


def test_low_rank_factors_reconstruct_the_clients_rows() -> None:
    net = LowRankFactors(dim=5, rank=2, max_rows=4)
    assert net.U.abs().sum() == 0 and net.V.abs().sum() == 0  # both start at zero
    with torch.no_grad():
        net.U.copy_(torch.arange(8, dtype=torch.float64).view(4, 2))
        net.V.copy_(torch.arange(10, dtype=torch.float64).view(5, 2) / 10)
    rows = torch.tensor([3.0, 0.0])  # row indices arrive as floats from the data
    expected = torch.stack([net.U.data[3] @ net.V.data.T, net.U.data[0] @ net.V.data.T])
    torch.testing.assert_close(net(rows), expected)
    assert LowRankFactors.data_defaults_only == frozenset({"rank", "max_rows"})
    with pytest.raises(ConfigError, match="dim, rank and max_rows are needed"):
        LowRankFactors(dim=5, rank=2)
