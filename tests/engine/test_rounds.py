"""``fl_lightning/engine/rounds.py``: client sampling as a pure function of seed and round, ``ClientSampler`` and
``RoundLoader``."""

from __future__ import annotations

import hashlib

import torch

from fl_lightning.engine.rounds import ClientSampler, RoundLoader


def test_sampling_is_a_pure_function_of_seed_and_round():
    a, b = ClientSampler(100, 10, seed=7), ClientSampler(100, 10, seed=7)
    late = [b.sample(r) for r in range(20, 0, -1)][::-1]  # drawn in the opposite order
    early = [a.sample(r) for r in range(1, 21)]
    assert all(torch.equal(x, y) for x, y in zip(early, late))
    assert all(len(set(s.tolist())) == 10 for s in early)  # without replacement
    assert not torch.equal(ClientSampler(100, 10, seed=8).sample(3), a.sample(3))
    assert len({tuple(s.tolist()) for s in early}) > 15  # rounds differ
    counts = torch.bincount(torch.cat([a.sample(r) for r in range(2000)]), minlength=100).float()
    assert (counts / 2000 - 0.1).abs().max() < 0.03  # uniform


SEED, CLIENTS, PER_ROUND = 4, 20, 5


def _cohort(round_idx: int) -> list[int]:
    digest = hashlib.blake2b(repr((SEED, "cohort", round_idx)).encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)
    return sorted(torch.randperm(CLIENTS, generator=gen)[:PER_ROUND].tolist())


def test_sampler_cohort_is_the_seeded_permutations_first_clients() -> None:
    sampler = ClientSampler(CLIENTS, PER_ROUND, SEED)
    cohorts = [sampler.sample(r).tolist() for r in range(6)]
    assert cohorts == [_cohort(r) for r in range(6)]
    assert len({tuple(c) for c in cohorts}) > 1  # the rounds' cohorts differ


def test_round_loader_yields_each_round_once_and_restarts_at_zero() -> None:
    loader = RoundLoader(ClientSampler(CLIENTS, PER_ROUND, SEED), 3)
    for _ in range(2):  # a second pass (e.g. a second fit) starts from round 0 again
        items = list(loader)
        assert [int(b["round"]) for b in items] == [0, 1, 2]
        assert [b["clients"].tolist() for b in items] == [_cohort(r) for r in range(3)]
        assert loader.state_dict() == {"next_round": 0}


def test_round_loader_resumes_from_its_saved_round() -> None:
    loader = RoundLoader(ClientSampler(CLIENTS, PER_ROUND, SEED), 4)
    loader.load_state_dict({"next_round": 2})
    assert [int(b["round"]) for b in loader] == [2, 3]
    assert [int(b["round"]) for b in loader] == [0, 1, 2, 3]


def test_floyd_sample_is_uniform_distinct_and_sorted() -> None:
    """Every k-subset is equally likely: over 6000 draws of 2 of 4 clients, each of the 6 pairs appears about
    1000 times (a chi-square bound at p ≈ 1e-6 for 5 degrees of freedom)."""
    from collections import Counter

    from fl_lightning.engine.rounds import floyd_sample

    g = torch.Generator().manual_seed(0)
    counts = Counter(tuple(floyd_sample(4, 2, g).tolist()) for _ in range(6000))
    assert sorted(counts) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    chi2 = sum((c - 1000) ** 2 / 1000 for c in counts.values())
    assert chi2 < 35.9
    big = floyd_sample(10**9, 50, g)
    assert big.tolist() == sorted(set(big.tolist())) and len(big) == 50
    assert 0 <= int(big.min()) and int(big.max()) < 10**9


def test_cohorts_of_large_populations_are_drawn_without_a_permutation_of_all_clients(monkeypatch) -> None:
    """Above ``PERMUTATION_CLIENTS`` no round calls ``randperm`` (O(N)); below, cohorts are the permutation's head."""
    from fl_lightning.client import make_generator
    from fl_lightning.engine import rounds

    small = ClientSampler(100, 5, seed=3)
    head = torch.randperm(100, generator=make_generator(3, "cohort", 7))[:5].sort().values
    assert torch.equal(small.sample(7), head)
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("randperm")))
    large = rounds.PERMUTATION_CLIENTS + 1
    cohort = ClientSampler(large, 10, seed=3).sample(7)
    assert len(set(cohort.tolist())) == 10 and torch.equal(cohort, ClientSampler(large, 10, seed=3).sample(7))
