"""``datamodules/mixed_regression.py`` (spec 001): the C1–C3 settings, data that follow the mixed linear model, the
generator at any setting and its one-line refusals, the permutation distance and the clustering error."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from datamodules.mixed_regression import (
    SETTINGS,
    MixedRegressionDataModule,
    clustering_error,
    mixed_regression_problem,
    parse_sizes,
    permutation_distance,
)
from fl_lightning.errors import ConfigError
from fl_lightning.models import ClusteredLinear
from tests.helpers.asserts import assert_close_finite


def test_settings_match_the_spec():
    for name, (sizes, probs) in SETTINGS.items():
        n = np.array(sizes, dtype=float)
        chi2 = len(n) * ((n / n.sum()) ** 2).sum() - 1
        assert n.sum() == 10_000 and len(probs) == 3
        assert chi2 == pytest.approx(0.0 if name == "C1" else 0.288, abs=1e-3)
    assert len(SETTINGS["C2"][0]) == 920 and SETTINGS["C3"][1] == [0.2, 0.3, 0.5]



def test_data_follow_the_model():
    p = mixed_regression_problem([200] * 6, [0.5, 0.5], 4, 0.0, torch.Generator().manual_seed(3))
    for c in range(6):
        lo, hi = int(p["ptr"][c]), int(p["ptr"][c + 1])
        pred = p["x"][lo:hi] @ p["theta_star"][p["labels"][c]]
        assert_close_finite(pred, p["y"][lo:hi], rtol=1e-5, atol=1e-8)



def test_permutation_distance_and_clustering_error_against_brute_force():
    rng = np.random.default_rng(0)
    star, est = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    ref = min(max(np.linalg.norm(est[p[j]] - star[j]) for j in range(3)) for p in itertools.permutations(range(3)))
    d, perm = permutation_distance(torch.tensor(est), torch.tensor(star))
    assert d == pytest.approx(ref)
    labels = torch.tensor([0, 1, 2, 2])
    assigned = torch.tensor(perm)[labels]
    assigned[0] = (assigned[0] + 1) % 3
    assert clustering_error(assigned, labels, perm) == pytest.approx(0.25)


def test_mixed_regression_generator_at_any_setting():
    assert parse_sizes("3x4,2x6") == [4, 4, 4, 6, 6]
    dm = MixedRegressionDataModule(setting=None, sizes="3x4,2x6", num_clusters=4, dim=7, noise=0.0, theta_scale=2.0)
    dm.setup()
    fed = dm.federated
    assert dm.probs == [0.25] * 4 and fed.train.sizes.tolist() == [4, 4, 4, 6, 6]
    star, labels = fed.extras["theta_star"].numpy(), fed.extras["labels"].numpy()
    assert star.shape == (4, 7) and 1.0 < np.linalg.norm(star, axis=1).mean() / np.sqrt(7) < 3.0  # c = 2
    owner = fed.train.client_ids().numpy()
    assert_close_finite(fed.train.y.numpy(), np.sum(fed.train.x.numpy() * star[labels[owner]], 1), atol=1e-12, rtol=0)
    c3 = MixedRegressionDataModule(setting="C3", num_clusters=3)
    assert c3.probs == [0.2, 0.3, 0.5] and len(c3.sizes) == 920  # a preset keeps its p when k agrees
    assert MixedRegressionDataModule(setting="C1", num_clusters=5).probs == [0.2] * 5
    for bad, match in (
        (dict(setting=None), "sizes"),
        (dict(setting=None, sizes="10x5"), "probs or num_clusters"),
        (dict(sizes="10by5"), "COUNTxSIZE"),
        (dict(probs=[0.5, 0.6]), "distribution"),
        (dict(probs=[0.5, 0.5], num_clusters=3), "num_clusters=3"),
        (dict(sizes=[3, 0]), "≥ 1 sample"),
        (dict(noise=-0.1), "noise"),
    ):
        with pytest.raises(ConfigError, match=match):
            MixedRegressionDataModule(**bad)
    with pytest.raises(ConfigError, match="dim"):
        ClusteredLinear(2, None)
