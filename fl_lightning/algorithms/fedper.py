"""FedPer (Arivazhagan et al., 2019; spec 000 §2.4): simultaneous SGD on body and head, personal head.

Only the body is averaged; the head (final layer) never leaves the client.
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.fedavg import FedAvg


class FedPer(FedAvg):
    vectorizable = True  # written only with ctx.sgd and dict operations

    def __init__(self, local_epochs: int = 1, personal: Sequence[str] = ("head.",)) -> None:
        super().__init__(local_epochs, personal)
