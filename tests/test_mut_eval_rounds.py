"""``rounds.ClientSampler`` and ``rounds.RoundLoader`` against a reference written here: the cohort of round ``t``
is the sorted first ``k`` of ``randperm(num_clients)`` drawn from a generator seeded with the low 63 bits of the
BLAKE2b digest of ``repr((seed, "cohort", t))``; the loader yields rounds ``0 .. num_rounds − 1`` and starts over
from round 0 on the next pass."""

from __future__ import annotations

import hashlib

import torch

from fl_lightning.engine.rounds import ClientSampler, RoundLoader

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
