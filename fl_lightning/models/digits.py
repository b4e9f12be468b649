"""Small models for scikit-learn's 8×8 digits (bundled, real data)."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from fl_lightning.models.split import SplitModel, mlp_layers, without_batchnorm


class DigitsMLP(SplitModel):
    """Small MLP for 8×8 digits: 64→hidden… →classes, head = final linear layer."""

    def __init__(self, num_classes: int = 10, hidden: tuple[int, ...] = (128, 64)) -> None:
        body = nn.Sequential(OrderedDict(flatten=nn.Flatten(), **mlp_layers([64, *hidden])))
        super().__init__(body, nn.Linear(hidden[-1], num_classes))


class DigitsCNN(SplitModel):
    """Small CNN for 1×8×8 digits: conv 1→16, conv 16→32 (3×3, pad 1, pool 2), fc 128→64, head 64→classes.

    ``batchnorm=True`` is the BatchNorm variant for FedBN: ``body.bn1``, ``body.bn2`` (BatchNorm2d) after the two
    convs, before their ReLU. The fc layer gets none (FedBN's own networks also normalise fc layers, Li et al. 2021
    §5): a BatchNorm1d cannot train on a one-sample last minibatch, which clients with n ≡ 1 (mod batch) have. The
    other layers keep their names, so both variants address ``body.conv1`` … ``head`` alike.
    """

    def __init__(self, num_classes: int = 10, batchnorm: bool = False) -> None:
        layers = OrderedDict(conv1=nn.Conv2d(1, 16, 3, padding=1), bn1=nn.BatchNorm2d(16), relu1=nn.ReLU())
        layers.update(pool1=nn.MaxPool2d(2), conv2=nn.Conv2d(16, 32, 3, padding=1), bn2=nn.BatchNorm2d(32))
        layers.update(relu2=nn.ReLU(), pool2=nn.MaxPool2d(2), flatten=nn.Flatten())
        layers.update(fc1=nn.Linear(128, 64), relu3=nn.ReLU())
        body = nn.Sequential(without_batchnorm(layers) if not batchnorm else layers)
        super().__init__(body, nn.Linear(64, num_classes))
