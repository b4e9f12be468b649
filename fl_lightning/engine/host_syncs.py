"""Counting the reads of tensor values back to the host: on a GPU each one waits for the device to finish.

``count_host_reads()`` patches the Python-level reads on ``torch.Tensor`` (``item``, ``__float__``, ``__int__``,
``__bool__``, ``__index__``, ``tolist``, ``cpu``, ``numpy``) for the duration of a ``with`` block and counts them,
on any device (on the CPU the same calls would be syncs on a GPU). ``make bench`` reports them per round;
``tests/engine/test_host_syncs.py`` holds a round to a bound that does not grow with the number of local steps.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy")


class HostReads:
    """How many reads happened while counting, in total and by method."""

    def __init__(self) -> None:
        self.by_method: Counter[str] = Counter()
        self.active = True

    @property
    def count(self) -> int:
        return sum(self.by_method.values())


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count ``torch.Tensor`` reads to the host inside the block (not thread-safe: patches the class)."""
    reads = HostReads()
    own = {name: torch.Tensor.__dict__.get(name) for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str, method: Callable) -> Callable:
        def read(self: torch.Tensor, *args, **kwargs):
            if reads.active:
                reads.by_method[name] += 1
            return method(self, *args, **kwargs)

        return read

    try:
        for name, method in originals.items():
            setattr(torch.Tensor, name, counting(name, method))
        yield reads
    finally:
        reads.active = False
        for name in READS:
            if own[name] is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own[name])
