"""The communication ledger: the one place every client upload passes through.

It enforces the privacy boundary (no personal parameter, no side information ever enters an upload)
and counts the bytes that the communication metrics report.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from fl_lightning.metrics import tensor_bytes


class PrivacyViolation(RuntimeError):
    pass


class CommunicationLedger:
    #: called as ``observer(ledger, round, client, upload)`` for every upload of every ledger (tests, audits)
    global_observers: list[Callable[[CommunicationLedger, int, int, dict[str, Tensor]], None]] = []

    def __init__(self, is_personal: Callable[[str], bool], allowed: set[str]) -> None:
        self.is_personal, self.allowed = is_personal, allowed
        self.upload_bytes = 0
        self.download_bytes = 0
        self.observers: list[Callable[[int, int, dict[str, Tensor]], None]] = []

    def new_round(self) -> None:
        self.upload_bytes = 0
        self.download_bytes = 0

    def upload(self, round_idx: int, client: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        for name in tensors:
            if name not in self.allowed or self.is_personal(name) or name.startswith("side_info"):
                raise PrivacyViolation(
                    f"client {client} tried to upload '{name}' in round {round_idx}: "
                    "it is personal or not in the algorithm's upload template"
                )
        self.upload_bytes += tensor_bytes(tensors)
        for observer in self.observers:
            observer(round_idx, client, tensors)
        for observer in CommunicationLedger.global_observers:
            observer(self, round_idx, client, tensors)
        return tensors

    def download(self, tensors: dict[str, Tensor], num_clients: int) -> None:
        self.download_bytes += tensor_bytes(tensors) * num_clients
