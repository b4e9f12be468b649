"""``datamodules/synthetic.py``: the synthetic linear-representation data (spec 000 §3.1, spec 004): head draws, the
population target, train and test noise, the new clients' own stream, and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules import SyntheticLinearDataModule
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite


def test_synthetic_linear_generator_arguments():
    kw = dict(num_clients=50, dim=6, rank=3, samples_per_client=4, seed=0)
    for heads, check in (
        ("fixed_norm", lambda w: np.allclose(np.linalg.norm(w, axis=1), np.sqrt(3))),
        ("qr", lambda w: np.allclose(w.T @ w, 3 * np.eye(3))),
        ("gaussian", lambda w: not np.allclose(np.linalg.norm(w, axis=1), np.linalg.norm(w[0]))),
    ):
        dm = SyntheticLinearDataModule(**kw, heads=heads)
        dm.setup()
        ex = dm.federated.extras
        assert check(ex["W_star"].numpy()) and ex["B_star"].dtype == torch.float64
        expected = ex["W_star"].numpy() @ ex["B_star"].numpy().T
        assert_close_finite(ex["population_target"].numpy(), expected, rtol=1e-12, atol=1e-14)
    dm = SyntheticLinearDataModule(**kw, head_norm=2.0, noise_variance=0.0, test_noise_variance=0.25)
    dm.setup()
    fed = dm.federated
    assert np.allclose(fed.extras["W_star"].norm(dim=1).numpy(), 2.0)
    theta = fed.extras["population_target"].numpy()
    owner = fed.train.client_ids().numpy()
    assert_close_finite(fed.train.y.numpy(), np.sum(fed.train.x.numpy() * theta[owner], 1), atol=1e-12, rtol=0)
    noise = fed.test.y.numpy() - np.sum(fed.test.x.numpy() * theta[fed.test.client_ids().numpy()], 1)
    assert 0.2 < noise.var() < 0.3  # test noise variance 0.25, 2500 draws
    # new clients: their own stream (the training clients do not change), exact population test split
    dm2 = SyntheticLinearDataModule(**kw, head_norm=2.0, noise_variance=0.0, test_noise_variance=0.25, new_clients=4)
    dm2.setup()
    assert torch.equal(dm2.federated.train.x, fed.train.x) and dm2.new_clients.num_clients == 4
    v = np.random.default_rng(0).normal(size=6)
    xt, yt = dm2.new_clients.test.client(1)
    theta_new = dm2.new_clients.extras["population_target"][1].numpy()
    assert np.mean((xt.numpy() @ v - yt.numpy()) ** 2) == pytest.approx(np.sum((v - theta_new) ** 2), rel=1e-12)
    for bad in (dict(rank=7), dict(samples_per_client=0), dict(noise_variance=-1.0), dict(heads="qr", num_clients=2),
                dict(head_norm=0.0), dict(new_clients=2, new_client_samples=0)):  # fmt: skip
        with pytest.raises(ConfigError):
            SyntheticLinearDataModule(**{**kw, **bad})
