"""Tensors an algorithm creates itself are made on the device of the tensors it was given, so a run on an
accelerator never mixes devices. PyTorch's ``meta`` device stands in for the accelerator: an operation between a
``meta`` tensor and a CPU tensor raises, so a tensor made on the default device shows here without a GPU.

Pinned: IFCA's proximal local solve (its identity matrix) and FedProto's prototype buffers when resized.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite

from fl_lightning.algorithms.fedproto import FedProto
from fl_lightning.algorithms.ifca import refine


@pytest.mark.parametrize("d", [3, 1])
def test_ifca_prox_refine_is_the_closed_form_and_stays_on_the_inputs_device(d: int):
    """θ = (I + (η/n) XᵀX)⁻¹ (θ₀ + (η/n) Xᵀy) per client, in numpy (also with one feature: the result keeps its
    shape [clients, d]); then the same call on ``meta`` inputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    y = torch.randn(2, 5, generator=g, dtype=torch.float64)
    start = torch.randn(2, d, generator=g, dtype=torch.float64)
    lr, n = 0.3, 5
    want = np.stack([
        np.linalg.solve(np.eye(d) + lr / n * xb.T @ xb, sb + lr / n * xb.T @ yb)
        for xb, yb, sb in zip(x.numpy(), y.numpy(), start.numpy())
    ])  # fmt: skip
    got = refine(x, y, start, lr, steps=7, solver="prox")
    assert got.shape == (2, d)
    assert_close_finite(got, want)
    on_meta = refine(x.to("meta"), y.to("meta"), start.to("meta"), lr, steps=7, solver="prox")
    assert on_meta.device.type == "meta" and on_meta.shape == (2, d)


def test_fedproto_resized_prototypes_are_zero_and_on_the_buffers_device():
    alg = FedProto()
    alg.size_prototypes(3, 4)
    assert torch.equal(alg.global_prototypes, torch.zeros(3, 4))
    assert torch.equal(alg.prototype_counts, torch.zeros(3))
    moved = FedProto().to("meta")
    moved.size_prototypes(3, 4)
    assert moved.global_prototypes.device.type == "meta" and moved.global_prototypes.shape == (3, 4)
    assert moved.prototype_counts.device.type == "meta" and moved.prototype_counts.shape == (3,)
    assert moved.known.device.type == "meta"


def test_fedproto_keeps_prototypes_of_the_right_size():
    """Already ``[classes, features]`` (e.g. restored from a checkpoint): kept as they are."""
    alg = FedProto()
    alg.size_prototypes(2, 3)
    alg.global_prototypes.fill_(1.5)
    alg.prototype_counts.fill_(4.0)
    alg.size_prototypes(2, 3)
    assert torch.equal(alg.global_prototypes, torch.full((2, 3), 1.5))
    assert torch.equal(alg.prototype_counts, torch.full((2,), 4.0))
