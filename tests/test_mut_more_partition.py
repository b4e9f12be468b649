"""``split_clients`` edge cases (empty clients with stratification, a fraction that rounds to every sample) and
``Dirichlet``'s defaults seen through a scripted random generator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datamodules.partition import Dirichlet, split_clients
from fl_lightning.errors import ConfigError


def test_stratified_split_of_an_empty_client_gives_empty_long_sets() -> None:
    labels = torch.tensor([0, 1, 0, 1])
    train, test = split_clients([[], [0, 1, 2, 3]], 0.5, np.random.default_rng(0), labels)
    assert train[0].tolist() == [] and test[0].tolist() == []
    assert train[0].dtype == torch.long and test[0].dtype == torch.long
    # client 1: one of each class goes to test (round(0.5 · 2) = 1 per class)
    assert sorted(labels[test[1]].tolist()) == [0, 1] and sorted(labels[train[1]].tolist()) == [0, 1]
    assert sorted(train[1].tolist() + test[1].tolist()) == [0, 1, 2, 3]


def test_unstratified_split_of_an_empty_list_client() -> None:
    train, test = split_clients([[]], 0.5, np.random.default_rng(0))
    assert train[0].tolist() == [] and test[0].tolist() == []


def test_a_fraction_rounding_to_every_sample_still_keeps_one_for_training() -> None:
    """0.9 · 2 rounds to 2; two samples keep one on each side. With 3 samples 0.9 · 3 → 3 is capped to 2."""
    train, test = split_clients([[5, 6], [7, 8, 9]], 0.9, np.random.default_rng(0))
    assert [len(t) for t in train] == [1, 1] and [len(t) for t in test] == [1, 2]
    assert sorted(train[0].tolist() + test[0].tolist()) == [5, 6]
    assert sorted(train[1].tolist() + test[1].tolist()) == [7, 8, 9]


class _ScriptedRng:
    """Hands out scripted Dirichlet proportions (the last one repeats) and identity permutations."""

    def __init__(self, draws: list[list[float]]) -> None:
        self.draws, self.alphas = draws, []

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        self.alphas.append(np.asarray(alpha).tolist())
        return np.asarray(self.draws[min(len(self.alphas) - 1, len(self.draws) - 1)])

    def permutation(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)


def test_dirichlet_defaults_alpha_half_and_two_samples_per_client() -> None:
    """One class of 4 samples, 2 clients. p = (0.9, 0.1) cuts at ⌊3.6⌋ = 3: sizes 3, 1 < 2, redrawn;
    p = (0.5, 0.5) gives 2, 2: accepted with the default ``min_samples`` = 2."""
    rng = _ScriptedRng([[0.9, 0.1], [0.5, 0.5]])
    y = torch.zeros(4, dtype=torch.long)
    train, test = Dirichlet()(y, y[:0], 2, rng)  # type: ignore[arg-type]
    assert [t.tolist() for t in train] == [[0, 1], [2, 3]]
    assert [len(t) for t in test] == [0, 0]
    assert rng.alphas == [[0.5, 0.5], [0.5, 0.5]]


def test_dirichlet_default_gives_up_after_100_draws() -> None:
    rng = _ScriptedRng([[1.0, 0.0]])  # client 1 never gets a sample
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigError, match="no draw in 100 tries"):
        Dirichlet()(y, y[:0], 2, rng)  # type: ignore[arg-type]
    assert len(rng.alphas) == 100
