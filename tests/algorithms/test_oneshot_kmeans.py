"""One-shot clustering (``OneShotClustering``) on hand-built clients: round 0's uploads (each client's minimum-norm
least-squares estimate in its own row), the server's k-means on them (sklearn called here with the same settings)
and the fixed cluster choice after, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from torch.nn import functional as F

from fl_lightning.algorithms import OneShotClustering
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.algorithms.oneshot_kmeans import kmeans, local_estimate
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.models import ClusteredLinear
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

D = 3


SIZES = [5, 2, 6, 4, 7, 5, 3]  # client 1 has fewer points than dimensions: the minimum-norm solution


def clients() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(4)
    centres = np.array([[2.0, -1.0, 0.5], [-1.5, 2.0, 1.0]])
    out = []
    for c, n in enumerate(SIZES):
        x = rng.normal(size=(n, D))
        out.append((x, x @ centres[c % 2] + 0.05 * rng.normal(size=n)))
    return out


def context(net, c: int, x: np.ndarray, y: np.ndarray, rnd: int) -> ClientContext:
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return client_context(
        net, torch.tensor(x), torch.tensor(y), client=c, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, c),
        round_idx=rnd,
    )


def test_local_estimate_is_the_minimum_norm_least_squares_solution():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(2, 4)), rng.normal(size=2)  # under-determined
    ref = np.linalg.lstsq(x, y, rcond=None)[0]
    assert_close_finite(local_estimate(torch.tensor(x), torch.tensor(y)), ref, rtol=1e-10, atol=1e-12)


def _draw_with_many_optima() -> np.ndarray:
    """16 Gaussian points for 5 clusters on which 1, 10 and 11 seeded restarts end at three different inertias
    (searched, so that the check does not rest on one scikit-learn version's random stream)."""
    for seed in range(74, 274):
        pts = np.random.default_rng(seed).normal(size=(16, 2)).astype(np.float32).astype(np.float64)
        inertia = [KMeans(n_clusters=5, n_init=n, random_state=0).fit(pts).inertia_ for n in (1, 10, 11)]
        a, b, c = inertia
        if all(abs(u - v) > 1e-6 * max(abs(u), abs(v)) for u, v in ((a, b), (b, c), (a, c))):
            return pts
    raise AssertionError("no draw among 200 tells 1, 10 and 11 restarts apart")


def test_kmeans_defaults_are_ten_seeded_restarts():
    """On a draw where 1, 10 and 11 restarts end apart, ``kmeans`` equals scikit-learn's 10 restarts from seed 0."""
    pts = _draw_with_many_optima()
    labels, centres = kmeans(torch.tensor(pts, dtype=torch.float32), 5)
    km = KMeans(n_clusters=5, n_init=10, random_state=0).fit(pts)
    assert labels.dtype == torch.long and centres.dtype == torch.float32
    assert torch.equal(labels, torch.as_tensor(km.labels_, dtype=torch.long))
    assert_close_finite(centres, km.cluster_centers_, rtol=1e-5, atol=1e-6)
    for n_init in (1, 11):  # the draw tells the restart counts apart
        other = KMeans(n_clusters=5, n_init=n_init, random_state=0).fit(pts)
        assert other.inertia_ != pytest.approx(km.inertia_, rel=1e-6)


def test_oneshot_round_zero_clusters_the_local_estimates_and_fixes_the_labels():
    data = clients()
    net = ClusteredLinear(2, D, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = OneShotClustering(seed=5, restarts=3, local_steps=2, lr=0.1)
    assert algo.warmup_rounds == 1
    algo.setup(glob, len(SIZES))
    assert torch.equal(algo.labels, torch.zeros(len(SIZES), dtype=torch.long))
    extra = algo.extra_uploads(glob)
    assert extra["estimates"].shape == (len(SIZES), D) and extra["estimate_mask"].shape == (len(SIZES),)
    assert extra["estimates"].dtype == extra["estimate_mask"].dtype == glob["theta"].dtype == torch.float64

    uploads, sizes, refs = [], [], []
    for c, (x, y) in enumerate(data):
        up = algo.client_update(context(net, c, x, y, 0), glob, {})
        ref = np.linalg.lstsq(x, y, rcond=None)[0]
        refs.append(ref)
        expected = np.zeros((len(SIZES), D))
        expected[c] = ref
        assert_close_finite(up.upload["estimates"], expected, rtol=1e-9, atol=1e-12, msg=f"client {c}")
        assert_close_finite(up.upload["estimate_mask"], np.eye(len(SIZES))[c], rtol=0, atol=0)
        assert_close_finite(up.upload["theta"], glob["theta"], rtol=0, atol=0)
        assert up.num_samples == SIZES[c]
        uploads.append(up.upload)
        sizes.append(SIZES[c])
    total = sum(sizes)
    averaged = {n: sum(u[n] * s for u, s in zip(uploads, sizes)) / total for n in uploads[0]}
    algo.server_update(glob, averaged, RoundFacts(0, num_aggregated=len(uploads)))

    km = KMeans(n_clusters=2, n_init=3, random_state=5).fit(np.stack(refs))
    assert torch.equal(algo.labels, torch.as_tensor(km.labels_, dtype=torch.long))
    assert_close_finite(glob["theta"], km.cluster_centers_, rtol=1e-6, atol=1e-8)
    assert len(set(km.labels_[0::2])) == 1 and len(set(km.labels_[1::2])) == 1 and km.labels_[0] != km.labels_[1]

    theta_after = glob["theta"].clone()
    for c, (x, y) in enumerate(data):
        assert algo.choose_cluster(context(net, c, x, y, 1), glob["theta"]) == int(km.labels_[c])
    # later rounds leave the labels (and the server's theta) to FedX: no second k-means
    shuffled = {n: v.flip(0) for n, v in averaged.items()}
    algo.server_update(glob, shuffled, RoundFacts(1, num_aggregated=len(uploads)))
    assert torch.equal(algo.labels, torch.as_tensor(km.labels_, dtype=torch.long))
    assert torch.equal(glob["theta"], theta_after)


def test_oneshot_ignores_the_rows_of_clients_that_sent_no_estimate():
    """A row with mask 0 (no upload) stays the zero vector instead of 0/0."""
    data = clients()[:4]
    net = ClusteredLinear(2, D, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = OneShotClustering(seed=0, restarts=2)
    algo.setup(glob, 5)  # client 4 never uploads
    uploads = [algo.client_update(context(net, c, x, y, 0), glob, {}).upload for c, (x, y) in enumerate(data)]
    averaged = {n: sum(u[n] for u in uploads) / len(uploads) for n in uploads[0]}
    algo.server_update(glob, averaged, RoundFacts(0, num_aggregated=len(uploads)))
    points = np.stack([np.linalg.lstsq(x, y, rcond=None)[0] for x, y in data] + [np.zeros(D)])
    km = KMeans(n_clusters=2, n_init=2, random_state=0).fit(points)
    assert torch.equal(algo.labels, torch.as_tensor(km.labels_, dtype=torch.long))
    assert_close_finite(glob["theta"], km.cluster_centers_, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name, value", [("seed", 0), ("restarts", 10), ("local_steps", 5), ("lr", 0.05)])
def test_oneshot_defaults(name, value):
    algo = OneShotClustering()
    assert getattr(algo, name) == value


def test_oneshot_passes_the_fedx_settings_to_ifca():
    algo = OneShotClustering(local_steps=3, lr=0.2, solver="prox")
    assert (algo.local_steps, algo.lr, algo.solver) == (3, 0.2, "prox")


def test_oneshot_estimates_in_the_models_dtype_from_float32_data():
    """x and y given in float32 to a float64 model are cast first: the estimate is the float64 solution."""
    x, y = clients()[0]
    x32, y32 = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    net = ClusteredLinear(2, D, seed=1)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = OneShotClustering()
    algo.setup(glob, 3)
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    ctx = client_context(net, x32, y32, client=2, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, 2))
    est = algo.client_update(ctx, glob, {}).upload["estimates"]
    assert est.dtype == torch.float64
    ref = np.linalg.lstsq(x32.double().numpy(), y32.double().numpy(), rcond=None)[0]
    assert_close_finite(est[2], ref, rtol=1e-10, atol=1e-12)
