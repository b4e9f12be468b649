"""FedProx's constructor: the defaults (μ = 0.1, one local epoch, no personal layers) and the personal split."""

from __future__ import annotations

from fl_lightning.algorithms import FedProx


def test_defaults_and_personal_prefixes():
    algo = FedProx()
    assert (algo.mu, algo.local_epochs, tuple(algo.personal)) == (0.1, 1, ())
    assert tuple(FedProx(personal=["head."]).personal) == ("head.",)
