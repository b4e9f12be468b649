"""``rounds.derive_seed``: the seed every random stream of a run starts from (cohorts, shuffles, augmentations).

It is pinned to its definition, the low 63 bits of the little-endian 8-byte BLAKE2b digest of ``repr(parts)``,
written out here with ``hashlib``: a seed that silently changed would change every run's numbers, and a seed of
64 bits or more is outside the 63-bit range it promises.
"""

from __future__ import annotations

import hashlib

import torch

from fl_lightning.engine.rounds import derive_seed, make_generator

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
