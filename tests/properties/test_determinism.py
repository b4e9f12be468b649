"""Determinism: the seed every random stream of a run starts from (``rounds.derive_seed``) and the same seed
giving the same metrics."""

from __future__ import annotations

import hashlib

import lightning as L
import torch

from fl_lightning.algorithms import FedRep
from fl_lightning.client import derive_seed, make_generator
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.digits_runs import digits
from tests.helpers.training import fit


def test_same_seed_gives_identical_metrics():
    def run(seed):
        L.seed_everything(seed, verbose=False)
        return fit(FederatedModule(FedRep(2, 1), DigitsMLP(), eval_every=1), digits(), rounds=4, seed=seed)

    first, second = run(0), run(0)
    assert first.history == second.history
    assert run(1).history != first.history


PARTS: list[tuple[int | str, ...]] = [
    (0,),
    (0, "cohort", 3),
    (7, "train", 12, 41),
    (123456789, "evaluation", 0, 0),
    ("x",),
    *[(s, "t", r) for s in range(4) for r in range(8)],
]


def _reference(*parts: int | str) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def test_derive_seed_is_the_low_63_bits_of_an_8_byte_blake2b_of_the_parts() -> None:
    """Every seed equals the hashlib reference and lies in [0, 2^63)."""
    for parts in PARTS:
        seed = derive_seed(*parts)
        assert seed == _reference(*parts), parts
        assert 0 <= seed < 2**63


def test_make_generator_is_seeded_with_the_derived_seed() -> None:
    """``make_generator(*parts)`` draws what a generator seeded with the reference seed draws."""
    for parts in PARTS[:5]:
        expected = torch.rand(4, generator=torch.Generator().manual_seed(_reference(*parts)))
        assert torch.equal(torch.rand(4, generator=make_generator(*parts)), expected)
