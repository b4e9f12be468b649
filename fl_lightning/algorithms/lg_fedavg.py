"""LG-FedAvg (Liang et al., 2020; spec 000 §2.4): personal lower layers, shared upper layers.

Joint local SGD on all parameters; the parameters under ``personal`` (the local representation) stay on
the client, the rest is averaged. The authors' CIFAR split keeps ``body.conv1``, ``body.conv2`` and
``body.fc1`` local (spec 000 §8.2).
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.fedavg import FedAvg


class LGFedAvg(FedAvg):
    vectorizable = True  # written only with ctx.sgd and dict operations

    def __init__(self, local_epochs: int = 1, personal: Sequence[str] = ("body.",)) -> None:
        super().__init__(local_epochs, personal)
