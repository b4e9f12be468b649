"""``experiments/linear_representation/features.py`` (spec 004 §4.2, Figure 4): the absolute cosine similarity of
per-class features against a numpy loop, and the mean of its off-diagonal."""

from __future__ import annotations

import numpy as np
import torch

from experiments.linear_representation.features import class_feature_cosine, mean_offdiagonal
from tests.helpers.linear_tasks import gen


def test_class_feature_cosine_is_the_mean_absolute_cosine_over_samples():
    feats = torch.randn(3, 4, 7, generator=gen(19))
    sim = class_feature_cosine(feats)
    f = feats.numpy()
    for c in range(3):
        for e in range(3):
            ref = np.mean(
                [abs(f[c, i] @ f[e, i]) / np.linalg.norm(f[c, i]) / np.linalg.norm(f[e, i]) for i in range(4)]
            )
            assert abs(float(sim[c, e]) - ref) < 1e-6
    assert abs(mean_offdiagonal(sim) - float(sim[~torch.eye(3, dtype=bool)].mean())) < 1e-7
