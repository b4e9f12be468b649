"""The models of FedRep's real-data experiments (spec 000 §3.2, §8.2): head = final linear layer."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel, mlp_layers, without_batchnorm


class CifarCNN(SplitModel):
    """The LG-FedAvg/FedRep 5-layer CNN (spec 000 §8.2, ``CNNCifar``): 2 conv + 3 FC, head = fc3.

    conv1 3→64 k5, pool, conv2 64→64 k5, pool, fc1 1600→120, fc2 120→64, head 64→classes.
    For CIFAR-100 the authors widen it (conv2 64→128, fc1 3200→256, fc2 256→128): ``wide=True``.
    ``batchnorm=True`` is the BatchNorm variant for FedBN: ``body.bn1``, ``body.bn2`` (BatchNorm2d) after the two
    convs, before their ReLU; the other layers keep their names. The fc layers get none (FedBN's own networks also
    normalise fc layers, Li et al. 2021 §5): a BatchNorm1d cannot train on a one-sample last minibatch.
    """

    def __init__(
        self, num_classes: int = 10, wide: bool = False, in_channels: int = 3, batchnorm: bool = False
    ) -> None:
        c2, f1, f2 = (128, 256, 128) if wide else (64, 120, 64)
        layers = OrderedDict(conv1=nn.Conv2d(in_channels, 64, 5), bn1=nn.BatchNorm2d(64), relu1=nn.ReLU())
        layers.update(pool1=nn.MaxPool2d(2), conv2=nn.Conv2d(64, c2, 5), bn2=nn.BatchNorm2d(c2), relu2=nn.ReLU())
        layers.update(pool2=nn.MaxPool2d(2), flatten=nn.Flatten(), fc1=nn.Linear(c2 * 25, f1), relu3=nn.ReLU())
        layers.update(fc2=nn.Linear(f1, f2), relu4=nn.ReLU())
        body = nn.Sequential(without_batchnorm(layers) if not batchnorm else layers)
        super().__init__(body, nn.Linear(f2, num_classes))


def refuse_batchnorm(network: str, batchnorm: bool) -> None:
    if batchnorm:
        raise ConfigError(
            f"{network} has no BatchNorm variant (batchnorm: true); FedBN needs a network with BatchNorm layers: "
            "DigitsCNN or CifarCNN with batchnorm: true"
        )


class FemnistMLP(SplitModel):
    """FedRep's FEMNIST MLP (spec 000 §8.2): 784→512→256→64 hidden, head 64→classes.

    The paper says "two hidden layers"; the authors' code has three. We follow the code's widths.
    It has no BatchNorm variant: ``batchnorm: true`` (what the FedBN configs ask of a Table-1 network) is refused.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_features: int = 784,
        hidden: tuple[int, ...] = (512, 256, 64),
        batchnorm: bool = False,
    ) -> None:
        refuse_batchnorm(type(self).__name__, batchnorm)
        body = nn.Sequential(OrderedDict(flatten=nn.Flatten(), **mlp_layers([in_features, *hidden])))
        super().__init__(body, nn.Linear(hidden[-1], num_classes))


class Sent140LSTM(SplitModel):
    """FedRep's Sent140 model (spec 000 §3.2): embedding → LSTM → fc → head (2 classes).

    Tokens are ids into ``embedding`` (``vocab_size × embed_dim``); ``Sent140DataModule(glove_path=...)``
    initialises it with GloVe vectors, and ``freeze_embedding`` keeps it fixed (the paper's frozen GloVe).
    The prediction uses the last time step's state. It has no BatchNorm variant (``batchnorm: true`` is refused).
    """

    def __init__(
        self,
        vocab_size: int = 10000,
        embed_dim: int = 300,
        hidden: int = 128,
        fc: int = 10,
        num_classes: int = 2,
        freeze_embedding: bool = False,
        batchnorm: bool = False,
    ) -> None:
        refuse_batchnorm(type(self).__name__, batchnorm)
        super().__init__(_LSTMBody(vocab_size, embed_dim, hidden, fc), nn.Linear(fc, num_classes))
        self.body.embedding.weight.requires_grad_(not freeze_embedding)


class _LSTMBody(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, fc: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(embed_dim, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, fc)

    def forward(self, tokens: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(tokens.long()))
        return torch.relu(self.fc(out[:, -1]))
