"""FedBN (X. Li et al., ICLR 2021, Algorithm 1): FedAvg whose BatchNorm layers stay on the clients.

Each sampled client trains the whole model (its own BN layers included) for ``local_epochs`` epochs of local SGD,
as in FedAvg. The server averages every parameter that does not belong to a BatchNorm layer; the BN layers' affine
weight and bias *and* their running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``) are
never uploaded and live in the client bank, so every client normalises its features with its own statistics
(the paper's remedy for feature-shift non-IID data, §3). The aggregation weights are the engine's
``model.aggregation`` (the configs weight by client size, as every Table-1 method here does).

``personal`` defaults to every BatchNorm layer of the network, found at set-up from the buffers a BN layer
carries (``<layer>.running_mean``); a network without one is a ``ConfigError``.

Both executors run it: the vectorized one keeps every client's BN statistics stacked ``[K, ...]`` and updates them
from the client's own batches as torch does (``fl_lightning.client.FunctionalBatchNorm``).

Privacy: the shared layers are trained through the client's BN affine parameters, so their upload depends on
them (in training mode BN normalises with the batch statistics, so not on the running statistics).
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.client import Params
from fl_lightning.errors import ConfigError

RUNNING_MEAN = "running_mean"


def batchnorm_prefixes(params: Params) -> tuple[str, ...]:
    """``("body.bn1.", …)``: the name prefix of every layer that keeps BatchNorm running statistics."""
    return tuple(n[: -len(RUNNING_MEAN)] for n in params if n.endswith("." + RUNNING_MEAN))


class FedBN(FedAvg):
    vectorizable = True  # ctx.sgd and dict operations; the stacked path keeps each client's BN statistics [K, ...]
    reveals = (
        "the non-BatchNorm layers after local SGD through the client's own BatchNorm layers (their affine "
        "parameters shape the update); the BN parameters and running statistics are never sent"
    )
    state_dependent_uploads = ("",)

    def __init__(self, local_epochs: int = 1, personal: Sequence[str] | None = None) -> None:
        super().__init__(local_epochs, personal)

    def setup(self, global_params: Params, num_clients: int) -> None:
        found = batchnorm_prefixes(global_params)
        if not found:
            raise ConfigError(
                "FedBN needs a network with BatchNorm layers (their parameters and statistics are what it keeps on "
                "the clients); this one has none: use DigitsCNN or CifarCNN with batchnorm: true"
            )
        if not self.personal:
            self.personal = found
