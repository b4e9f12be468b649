"""The communication ledger: the one place every client upload passes through.

It enforces the privacy boundary from the algorithm's *declarations*, not from its code: an upload name under one
of the algorithm's ``personal`` or ``state_prefixes`` prefixes, or named like an entry of the client-state bank, is
refused (the declared upload template may not contain one either), and so is any name outside the declared
template. It also records, per round, how many upload bytes the algorithm declares to depend on the clients'
personal state or side information (``Algorithm.reveals``), and counts the bytes of the communication metrics.

What crosses the boundary is not "nothing personal": the README's table lists, per algorithm, what an upload
may reveal; ``tests/properties/test_privacy.py`` checks each declaration by perturbing the personal state and the side
information and comparing the uploads bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from fl_lightning.client import name_matches
from fl_lightning.metrics import tensor_bytes


class PrivacyViolation(RuntimeError):
    pass


@dataclass
class RoundDisclosure:
    """One round's uploads and how many of their bytes may depend on personal state or side information."""

    round: int
    uploads: int = 0
    bytes: int = 0
    state_dependent_bytes: int = 0
    side_dependent_bytes: int = 0


def _under(name: str, prefixes: Iterable[str]) -> bool:
    return any(name_matches(name, p) for p in prefixes)


class CommunicationLedger:
    """Checks and counts every upload of one run.

    Args:
        personal: the algorithm's declared personal prefixes (model parameters that stay on the client).
        state_prefixes: its declared prefixes of other per-client state (Ditto ``v.``, SCAFFOLD ``c_i.``…).
        state_names: the names the client-state bank actually holds.
        template: the declared upload (name → tensor template); checked against the three above.
        reveals: the algorithm's one-line description of what its uploads may reveal.
        state_dependent: upload-name prefixes the algorithm declares may depend on personal state ("" = all).
        side_dependent: upload-name prefixes that may depend on side information (empty when the run has none).
        side_reveals: what the side-information branch lets the server read off an upload (None: no side info).
    """

    #: called as ``observer(ledger, round, client, upload)`` for every upload of every ledger (tests, audits)
    global_observers: list[Callable[[CommunicationLedger, int, int, dict[str, Tensor]], None]] = []

    def __init__(
        self,
        personal: Collection[str],
        state_prefixes: Collection[str],
        state_names: Collection[str],
        template: Collection[str],
        reveals: str = "",
        state_dependent: Collection[str] = (),
        side_dependent: Collection[str] = (),
        side_reveals: str | None = None,
    ) -> None:
        self.personal, self.state_prefixes = tuple(personal), tuple(state_prefixes)
        self.state_names = frozenset(state_names)
        self.reveals, self.side_reveals = reveals, side_reveals
        self.state_dependent, self.side_dependent = tuple(state_dependent), tuple(side_dependent)
        for name in template:
            if self.is_private(name):
                raise PrivacyViolation(
                    f"the upload template declares '{name}', which is personal client state "
                    "(a personal or state prefix of the algorithm, or a client-bank entry)"
                )
        self.allowed = frozenset(template)
        self.upload_bytes = 0
        self.download_bytes = 0
        self.history: list[RoundDisclosure] = []
        self.observers: list[Callable[[int, int, dict[str, Tensor]], None]] = []
        self._kinds: dict[str, tuple[bool, bool, bool]] = {}  #: ``_kind`` per upload name, matched once

    def _kind(self, name: str) -> tuple[bool, bool, bool]:
        """(refused, state-dependent, side-dependent) of an upload name: its prefixes are matched once per run."""
        kind = self._kinds.get(name)
        if kind is None:
            refused = name not in self.allowed or self.is_private(name)
            kind = (refused, _under(name, self.state_dependent), _under(name, self.side_dependent))
            self._kinds[name] = kind
        return kind

    @classmethod
    def for_algorithm(
        cls, algorithm: Any, state_names: Collection[str], template: Collection[str], side_reveals: str | None
    ) -> CommunicationLedger:
        """The ledger of a run, from the algorithm's declared attributes (never from its methods).
        ``side_reveals`` is None when the run has no side information."""
        return cls(
            algorithm.personal,
            algorithm.state_prefixes,
            state_names,
            template,
            algorithm.reveals,
            algorithm.state_dependent_uploads,
            algorithm.side_dependent_uploads if side_reveals is not None else (),
            side_reveals,
        )

    def is_private(self, name: str) -> bool:
        """Whether ``name`` is declared client-private: never uploaded, whatever the algorithm's code does."""
        return _under(name, self.personal) or _under(name, self.state_prefixes) or name in self.state_names

    def new_round(self, round_idx: int = -1) -> None:
        self.upload_bytes = 0
        self.download_bytes = 0
        self.history.append(RoundDisclosure(round_idx))

    def upload(self, round_idx: int, client: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        kinds = [self._kind(name) for name in tensors]
        for name, (refused, _, _) in zip(tensors, kinds):
            if refused:
                raise PrivacyViolation(
                    f"client {client} tried to upload '{name}' in round {round_idx}: "
                    "it is personal client state or not in the algorithm's declared upload"
                )
        size = tensor_bytes(tensors)
        self.upload_bytes += size
        if not self.history or self.history[-1].round != round_idx:
            self.history.append(RoundDisclosure(round_idx))
        record = self.history[-1]
        record.uploads += 1
        record.bytes += size
        record.state_dependent_bytes += tensor_bytes({n: t for (n, t), k in zip(tensors.items(), kinds) if k[1]})
        record.side_dependent_bytes += tensor_bytes({n: t for (n, t), k in zip(tensors.items(), kinds) if k[2]})
        for observer in self.observers:
            observer(round_idx, client, tensors)
        for observer in CommunicationLedger.global_observers:
            observer(self, round_idx, client, tensors)
        return tensors

    def download(self, tensors: dict[str, Tensor], num_clients: int) -> None:
        self.download_bytes += tensor_bytes(tensors) * num_clients

    def describe(self) -> str:
        """What this run's uploads may reveal, in words (the algorithm's declaration plus the side branch's)."""
        parts = [self.reveals or "nothing beyond the declared upload"]
        if self.side_reveals:
            parts.append(self.side_reveals)
        return "; ".join(parts)
