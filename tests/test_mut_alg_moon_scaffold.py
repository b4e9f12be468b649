"""MOON's and SCAFFOLD's constructor state: the authors' code defaults (MOON's main.py: μ = 1, τ = 0.5; one local
epoch), MOON's one-line network error, and SCAFFOLD with no server variate before ``setup``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_lightning.algorithms import MOON, SCAFFOLD
from fl_lightning.errors import ConfigError


def test_moon_defaults_are_the_authors_main_py_defaults():
    algo = MOON()
    assert (algo.mu, algo.temperature, algo.local_epochs) == (1.0, 0.5, 1)


def test_moon_refuses_a_network_without_body_and_says_why():
    why = r"\(a SplitModel\): its contrastive loss compares the body's representations;"
    with pytest.raises(ConfigError, match=why):
        MOON().check_compatible(nn.Linear(2, 2), 2)


def test_scaffold_before_setup_has_no_variates():
    algo = SCAFFOLD()
    assert algo.local_epochs == 1 and algo.num_clients == 0
    assert algo.server_variate() == {}
    assert algo.init_client_state({"w": torch.zeros(2)}) == {}
