"""MOON (Li et al. 2021; ``fl_lightning/algorithms/moon.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fl_lightning.algorithms import MOON
from fl_lightning.errors import ConfigError
from tests.helpers.round_references import (
    LR,
    MOMENTUM,
    Run,
    assert_matches,
    max_difference,
    mean_of,
    model_with,
    params_of,
)


# ---- MOON --------------------------------------------------------------------------------------------------------
def moon_client(template, glob, prev, x, y, mu, tau, epochs, swap=False):
    """Eq. 4: CE + μ·(−log e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ})), z = body(x)."""
    model, global_model, previous = (model_with(template, p) for p in (glob, glob, prev))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        z = model.body(x)
        with torch.no_grad():
            z_glob, z_prev = global_model.body(x), previous.body(x)
        if swap:
            z_glob, z_prev = z_prev, z_glob
        pos = torch.exp(F.cosine_similarity(z, z_glob) / tau)
        neg = torch.exp(F.cosine_similarity(z, z_prev) / tau)
        loss = F.cross_entropy(model.head(z), y) + mu * (-torch.log(pos / (pos + neg))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params_of(model)


def moon_reference(run, mu, tau, epochs, swap=False):
    w, prev = dict(run.init), {c: dict(run.init) for c in range(4)}
    for cohort in run.cohorts:
        uploads = []
        for c in cohort:
            prev[c] = moon_client(run.template, w, prev[c], *run.data[c], mu, tau, epochs, swap)
            uploads.append(prev[c])
        w = mean_of(uploads, [float(len(run.data[c][1])) for c in cohort])  # FedAvg, weighted by client size
    return w, prev


def test_moon_client_update_matches_the_reference_over_rounds():
    mu, tau, epochs = 5.0, 0.5, 3
    run = Run(MOON(mu=mu, temperature=tau, local_epochs=epochs), aggregation="num_samples")
    w, prev = moon_reference(run, mu, tau, epochs)
    assert_matches(run.global_params(), w, w)
    for c in range(4):
        assert_matches(run.bank("prev.", c), prev[c], w)
    swapped, _ = moon_reference(run, mu, tau, epochs, swap=True)  # positive and negative pairs swapped
    assert max_difference(run.global_params(), swapped) > 1e-4


def test_moon_without_the_contrastive_term_is_fedavg():
    from fl_lightning.algorithms import FedAvg

    moon = Run(MOON(mu=0.0, local_epochs=2), aggregation="num_samples")
    fedavg = Run(FedAvg(local_epochs=2), aggregation="num_samples")
    assert moon.cohorts == fedavg.cohorts
    assert_matches(moon.global_params(), fedavg.global_params(), moon.init, tol=1e-6)




def test_moon_refuses_a_network_without_body_and_says_why():
    why = r"\(a SplitModel\): its contrastive loss compares the body's representations;"
    with pytest.raises(ConfigError, match=why):
        MOON().check_compatible(nn.Linear(2, 2), 2)


def test_moon_defaults_are_the_authors_main_py_defaults():
    algo = MOON()
    assert (algo.mu, algo.temperature, algo.local_epochs) == (1.0, 0.5, 1)
