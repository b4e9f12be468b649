"""FedALA's argument checks at their boundaries, its layer grouping and the convergence test of its first-round
weight learning (``settled``: the std of the last ``window`` losses below ``threshold``), from hand-made inputs."""

from __future__ import annotations

import statistics

import pytest
import torch

from fl_lightning.algorithms.fedala import FedALA, settled
from fl_lightning.errors import ConfigError


@pytest.mark.parametrize(
    "bad", [dict(p=0), dict(s=0.0), dict(s=100.5), dict(eta=0.0), dict(window=1), dict(init_max_epochs=0)]
)
def test_each_out_of_range_argument_is_refused_alone(bad):
    with pytest.raises(ConfigError, match="FedALA needs p ≥ 1, 0 < s ≤ 100"):
        FedALA(**bad)


def test_the_boundaries_themselves_are_accepted():
    alg = FedALA(p=1, s=100.0, eta=1e-6, window=2, init_max_epochs=1)
    assert (alg.p, alg.s, alg.eta, alg.window, alg.init_max_epochs) == (1, 100.0, 1e-6, 2, 1)
    alg = FedALA(s=0.5)  # any positive percentage
    assert alg.s == 0.5


def test_defaults_are_the_papers():
    alg = FedALA()  # FedALA (Zhang et al. 2023): p = 1 layer, s = 80 %, eta = 1, threshold 0.1 over 10 losses
    assert (alg.local_epochs, alg.p, alg.s, alg.eta) == (1, 1, 80.0, 1.0)
    assert (alg.threshold, alg.window, alg.init_max_epochs) == (0.1, 10, 50)


def test_layers_group_float_tensors_by_module_and_leave_out_batchnorm_statistics():
    params = {
        "body.conv.weight": torch.zeros(2, 2), "body.conv.bias": torch.zeros(2),
        "body.bn.weight": torch.zeros(2), "body.bn.running_mean": torch.zeros(2), "body.bn.running_var": torch.ones(2),
        "body.bn.num_batches_tracked": torch.zeros((), dtype=torch.long), "head.weight": torch.zeros(3, 2),
    }  # fmt: skip
    layers = FedALA().layers(params)
    assert layers == {"body.conv": ["body.conv.weight", "body.conv.bias"], "body.bn": ["body.bn.weight"],
                      "head": ["head.weight"]}  # fmt: skip
    FedALA(p=3).setup(params, 4)  # three layers: p = 3 is fine
    with pytest.raises(ConfigError, match="p = 4 top layers"):
        FedALA(p=4).setup(params, 4)


def test_settled_needs_a_full_window_with_a_small_spread():
    flat = [1.0, 1.0, 1.0]
    assert not settled(flat[:2], window=3, threshold=0.1)  # fewer losses than the window
    assert settled(flat, window=3, threshold=0.1)
    wobbly = [0.0, 2.0, 4.0]
    spread = statistics.stdev(wobbly)  # 2.0 exactly; torch's std is the sample std, as here
    assert not settled(wobbly, window=3, threshold=spread)  # strictly below the threshold
    assert settled(wobbly, window=3, threshold=spread + 1e-3)
    assert settled([9.0, *flat], window=3, threshold=0.1)  # only the last window counts
