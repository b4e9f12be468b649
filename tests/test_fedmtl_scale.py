"""Fed-MTL's regulariser scale: the LG-FedAvg code's s = 10^−(digits of dim W + 1), with dim W counted over the
floating-point tensors only, and ``reg_scale`` overriding it."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.algorithms import FedMTL
from fl_lightning.algorithms.fedmtl import code_scale


@pytest.mark.parametrize("dim", [1, 9, 10, 99, 100, 999, 1000, 12345, 99999, 100000])
def test_code_scale_is_ten_to_minus_digits_plus_one(dim):
    assert code_scale(dim) == pytest.approx(10.0 ** -(len(str(dim)) + 1), rel=1e-12)


def test_fedmtl_setup_counts_only_floating_point_tensors():
    glob = {"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)}
    glob["steps"] = torch.zeros(5000, dtype=torch.long)
    alg = FedMTL()
    alg.setup(glob, num_clients=6)
    assert alg.num_clients == 6
    assert alg.scale == pytest.approx(1e-3, rel=1e-12)  # dim W = 17: two digits
    alg = FedMTL(reg_scale=0.25)
    alg.setup(glob, num_clients=6)
    assert alg.scale == 0.25


def test_fedmtl_defaults():
    alg = FedMTL()
    assert (alg.local_epochs, alg.reg_scale) == (1, None)
