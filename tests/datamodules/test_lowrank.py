"""``datamodules/lowrank.py`` (spec 003): the synthetic low-rank matrix and its spectrum forms (with their one-line
refusals), and the w8a, MNIST and CelebA loaders on small files written here in their real formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.lowrank import (
    LowRankDataModule,
    load_celeba,
    load_mnist,
    load_w8a,
    resolve_spectrum,
    synthetic_lowrank,
)
from fl_lightning.algorithms.lowrank_power import optimal_loss
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite

N, ROWS, D, R = 5, 40, 40, 5
MF = dict(num_clients=4, rows_per_client=30, dim=12, rank=3, noise=1e-3)


def test_synthetic_matrix_spectrum():
    noisy = synthetic_lowrank(N, ROWS, D, R, 1e-6, torch.Generator().manual_seed(2024))
    clean = synthetic_lowrank(N, ROWS, D, R, 0.0, torch.Generator().manual_seed(2024))
    sv = np.linalg.svd(clean.numpy(), compute_uv=False)
    assert clean.shape == (N * ROWS, D) and clean.dtype == torch.float64
    assert_close_finite(sv[:5], 1.0, rtol=1e-5, atol=1e-8)
    assert sv[5] < 1e-12
    fmin = optimal_loss(noisy, R)
    assert fmin == pytest.approx(0.5 * np.sum(np.linalg.svd(noisy.numpy(), compute_uv=False)[5:] ** 2))
    assert fmin == pytest.approx(0.5 * (N * ROWS - R) * (D - R) * 1e-12, rel=0.1)  # ½ E‖noise off the signal‖²



def test_loaders_read_real_formats(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["+1 3:0.5 7:1", "-1 1:2 300:1", "+1 2:1"]
    (tmp_path / "w8a").write_text("\n".join(lines) + "\n")
    w = load_w8a(tmp_path / "w8a")
    assert w.shape == (3, 300) and w[0, 2] == 0.5 and w[1, 299] == 1 and w.sum() == 5.5
    images = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], dtype=np.uint8)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(
        (2051).to_bytes(4, "big") + b"".join(v.to_bytes(4, "big") for v in (12, 28, 28)) + images.tobytes()
    )
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(
        (2049).to_bytes(4, "big") + (12).to_bytes(4, "big") + labels.tobytes()
    )
    x, y = load_mnist(tmp_path, max_rows=10)
    assert x.shape == (10, 784) and torch.equal(y, torch.as_tensor(labels[:10].astype(np.int64)))
    assert_close_finite(x.numpy(), images[:10].reshape(10, -1) / 127.5 - 1, rtol=1e-5, atol=1e-8)
    from PIL import Image

    (tmp_path / "img_align_celeba").mkdir()
    ident = []
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, size=(218, 178, 3), dtype=np.uint8)).save(
            tmp_path / "img_align_celeba" / f"{i:06d}.png"
        )
        ident.append(f"{i:06d}.png {1 + i % 2 if i < 3 else 7}")
    (tmp_path / "identity_CelebA.txt").write_text("\n".join(ident) + "\n")
    cx, owner = load_celeba(tmp_path, num_clients=2)
    assert cx.shape == (3, 3 * 32 * 32) and owner.tolist() == [0, 1, 0]
    dm = LowRankDataModule("w8a", num_clients=2, dim=300, path=str(tmp_path / "w8a"))
    dm.setup()
    assert dm.federated.train.sizes.tolist() == [2, 1]
    digits = LowRankDataModule("digits", num_clients=10, dim=64)
    digits.setup()
    assert digits.federated.train.y.shape == (1797, 64) and digits.federated.train.y.min() >= -1


def test_lowrank_spectrum_forms_and_validation():
    for spec, expected in (
        ({"linspace": [1, 0.5]}, np.linspace(1, 0.5, 3)),
        ({"geomspace": [1, 0.25]}, np.geomspace(1, 0.25, 3)),
        ([3.0, 2.0, 0.5], [3.0, 2.0, 0.5]),
        (None, np.ones(3)),
    ):
        dm = LowRankDataModule("synthetic", **{**MF, "noise": 0.0}, singular_values=spec, seed=1)
        dm.setup()
        sv = np.linalg.svd(dm.federated.train.y.numpy(), compute_uv=False)
        assert_close_finite(sv[:3], sorted(expected, reverse=True), rtol=1e-12, atol=0)
        assert sv[3] < 1e-12
    for bad, match in (
        ([1.0, 0.5], "2 values for rank 3"),
        ({"linspace": [1, 0]}, "positive"),
        ({"logspace": [1, 2]}, "linspace"),
        ([1.0, -1.0, 2.0], "positive"),
    ):
        with pytest.raises(ConfigError, match=match):
            resolve_spectrum(bad, 3)
    with pytest.raises(ConfigError, match="rank"):
        LowRankDataModule("synthetic", num_clients=2, rows_per_client=3, dim=12, rank=7)
    with pytest.raises(ConfigError, match="columns"):
        LowRankDataModule("digits", num_clients=10, dim=50).setup()
