"""``split_validation``'s counting rules, each against a hand count or an exact reference: the clamp of the
per-client quota to ``[1, n − 1]``, the largest-remainder share over classes (remainders, not totals), ties
broken in the rng's order by a *stable* sort, and the class-blind draw when there are no classes."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from datamodules.base import split_validation
from fl_lightning.engine.client_data import ClientSplit


class OrderedRng:
    """A stand-in for ``np.random.Generator`` whose "random" orders are the identity: ``permutation`` keeps
    its input's order and ``choice`` takes the first positions. With it every draw of ``split_validation``
    is fixed, so the tie-break order is the class order and each class gives its first rows."""

    def permutation(self, x: int | np.ndarray) -> np.ndarray:
        return np.arange(x) if isinstance(x, (int, np.integer)) else np.array(x, copy=True)

    def choice(self, n: int, size: int, replace: bool = True) -> np.ndarray:
        return np.arange(size)


def indexed(labels: list[int], sizes: list[int]) -> ClientSplit:
    """Clients of the given sizes; row ``i`` carries ``i`` as its feature, so rows can be read back."""
    ptr = torch.tensor([0, *np.cumsum(sizes).tolist()])
    return ClientSplit(torch.arange(len(labels)).unsqueeze(1), torch.tensor(labels), ptr)


def val_rows(val: ClientSplit, c: int) -> list[int]:
    return val.client(c)[0].flatten().tolist()


def test_quota_is_clamped_to_keep_one_row_on_each_side() -> None:
    """n = 2 and n = 3 at fraction 0.9: round(0.9·n) = n, clamped to n − 1; n = 2 at 0.2: round(0.4) = 0,
    raised to 1. With and without classes."""
    split = indexed([0, 1, 0, 1, 1, 0, 1], [2, 3, 2])
    for num_classes in (None, 2):
        train, val = split_validation(split, 0.9, num_classes, np.random.default_rng(0))
        assert val.sizes.tolist() == [1, 2, 1] and train.sizes.tolist() == [1, 1, 1], num_classes
        train, val = split_validation(split, 0.2, num_classes, np.random.default_rng(0))
        assert val.sizes.tolist() == [1, 1, 1] and train.sizes.tolist() == [1, 2, 1], num_classes


def test_extra_rows_go_to_the_largest_remainder_not_the_largest_class() -> None:
    """One client: 9 rows of class 0, 2 of class 1, fraction 0.45 → quota round(4.95) = 5. Shares 45/11 and
    10/11: floors 4 and 0 (sum 4), and the one extra row goes to class 1 (remainder 10/11 > 1/11)."""
    labels = [0] * 9 + [1] * 2
    train, val = split_validation(indexed(labels, [11]), 0.45, 2, np.random.default_rng(3))
    got = torch.bincount(val.y, minlength=2).tolist()
    assert got == [4, 1]
    assert sorted(val_rows(val, 0) + train.client(0)[0].flatten().tolist()) == list(range(11))


def test_remainder_ties_follow_the_rng_order_through_a_stable_sort() -> None:
    """20 classes, 32 rows, quota 6 (fraction 6/32): shares 6·c/32 are exact in binary, so equal counts tie.
    With the identity "permutation" the stable sort hands the extra rows to the lowest labels among the
    largest remainders; each class then gives its first rows. Reference: exact fractions, Python's sort."""
    counts = [2, 2, 1, 1, 1, 3, 1, 3, 3, 1, 3, 1, 1, 1, 1, 2, 1, 1, 2, 1]
    n, quota = sum(counts), 6
    labels = np.repeat(np.arange(len(counts)), counts)
    labels = labels[np.random.default_rng(7).permutation(n)]  # interleave the classes inside the client
    shares = [Fraction(quota * c, n) for c in counts]
    take = [int(s) for s in shares]  # floors (shares are positive)
    by_remainder = sorted(range(len(counts)), key=lambda k: (-(shares[k] - take[k]), k))
    for k in by_remainder[: quota - sum(take)]:
        take[k] += 1
    expected = sorted(i for k, t in enumerate(take) for i in np.flatnonzero(labels == k)[:t].tolist())
    train, val = split_validation(indexed(labels.tolist(), [n]), quota / n, len(counts), OrderedRng())
    assert val_rows(val, 0) == expected
    assert train.client(0)[0].flatten().tolist() == sorted(set(range(n)) - set(expected))


def test_without_classes_the_draw_ignores_the_labels() -> None:
    """``num_classes=None`` draws the quota uniformly over a client's rows: with 5 + 5 rows of two labels and
    quota 2, a class-blind draw picks two rows of one label with probability 4/9, so over 20 seeds some draw
    does; a stratified draw never would. With classes every draw is one row per label."""
    labels = [0] * 5 + [1] * 5
    split = indexed(labels, [10])
    blind = [sorted(split_validation(split, 0.2, None, np.random.default_rng(s))[1].y.tolist()) for s in range(20)]
    assert all(len(v) == 2 for v in blind)
    assert any(v != [0, 1] for v in blind)
    strat = [sorted(split_validation(split, 0.2, 2, np.random.default_rng(s))[1].y.tolist()) for s in range(20)]
    assert all(v == [0, 1] for v in strat)
