"""``fedx_round`` with fixed cluster labels (one-shot clustering): each client moves the row of its given label,
not the row eq. (8) would choose. Reference: numpy loops over the clients, as in ``test_one_fedx_round_is_lemma_1``."""

from __future__ import annotations

import numpy as np
import torch
from helpers import assert_close_finite
from test_mixed_regression import SMALL_SIZES, small_problem

from experiments import mixed_regression as mr
from fl_lightning.algorithms.ifca import assign_clusters, fedx_round


def test_fixed_labels_override_the_argmin_choice():
    p = small_problem()
    groups, _ = mr.client_groups(p)
    theta = torch.randn(2, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = [1 - assign_clusters(x, y, theta) for x, y, _ in groups]  # every client the other cluster
    lr, s = 0.05, 3
    new, chosen = fedx_round(groups, theta, lr, s, "gd", labels=labels)
    assert all(torch.equal(c, z) for c, z in zip(chosen, labels))
    x, y, ptr, n_total = p["x"].numpy(), p["y"].numpy(), p["ptr"].numpy(), len(p["x"])
    th = theta.numpy()
    ref = th.copy()
    for c in range(len(SMALL_SIZES)):
        xi, yi = x[ptr[c] : ptr[c + 1]], y[ptr[c] : ptr[c + 1]]
        n = len(yi)
        z = 1 - int(np.argmin([np.sum((yi - xi @ th[j]) ** 2) for j in range(2)]))
        a = np.eye(n) - lr * xi @ xi.T / n
        pmat = sum(np.linalg.matrix_power(a, ell) for ell in range(s))
        ref[z] -= (lr / n_total) * xi.T @ pmat @ (xi @ th[z] - yi)
    assert_close_finite(new.numpy(), ref, rtol=1e-5, atol=1e-12)


def test_chosen_clusters_are_returned_per_group():
    p = small_problem()
    groups, _ = mr.client_groups(p)
    theta = torch.randn(2, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, chosen = fedx_round(groups, theta, 0.05, 1)
    assert len(chosen) == len(groups)
    th = theta.numpy()
    for (x, y, _), z in zip(groups, chosen):  # eq. (8) in numpy: the row with the smallest squared residual
        residual = ((y.numpy()[..., None] - x.numpy() @ th.T) ** 2).sum(1)
        assert z.tolist() == residual.argmin(-1).tolist()
