"""Per-client side information ``z_m`` (spec 002 §1): a ``[num_clients, dim]`` tensor in ``FederatedData.side``.

The engine hands row ``m`` to client ``m``'s forward pass and never uploads it. Providers:

* ``ShiftOneHot``: one-hot of the client's feature-shift group (CIFAR, spec 002 §4.3);
* ``ClientOneHot``: one-hot client id (App. A: PerFedSI then generalises local parameters);
* ``ClientEmbedding``: the mean embedding of the client's training images under a classifier trained
  centrally on all clients' training samples to predict a group label (Omniglot: 50-way alphabet
  classifier, 256-d output of the last conv block; spec 002 §2.5);
* ``NoisySideInfo`` / ``MissingSideInfo``: wrappers that add Gaussian noise, or blank out the side
  information of a fraction of clients (not in the paper; spec 002 §8 R5).

``SideInfoDataModule`` wraps any ``FederatedDataModule``: it builds it, optionally applies a
``FeatureShift``, and attaches the side tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from datamodules.base import FederatedDataModule
from datamodules.feature_shift import FeatureShift
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel


class SideInfo:
    """Base class: ``__call__(fed, rng) -> [num_clients, dim]`` float tensor."""

    def __call__(self, fed: FederatedData, rng: np.random.Generator) -> Tensor:
        raise NotImplementedError


class ShiftOneHot(SideInfo):
    """``z_m = e_{g(m)}`` for the client's shift group ``g(m)`` (needs ``fed.extras["shift_group"]``)."""

    def __init__(self, num_groups: int = 4) -> None:
        self.num_groups = num_groups

    def __call__(self, fed, rng):
        if "shift_group" not in fed.extras:
            raise ConfigError("ShiftOneHot side information needs a feature shift (SideInfoDataModule.shift)")
        groups = fed.extras["shift_group"].long()
        if int(groups.max()) >= self.num_groups:
            raise ConfigError(f"ShiftOneHot(num_groups={self.num_groups}) but a client has group {int(groups.max())}")
        return F.one_hot(groups, self.num_groups).float()


class ClientOneHot(SideInfo):
    """``z_m = e_m ∈ R^M``."""

    def __call__(self, fed, rng):
        return torch.eye(fed.num_clients)


def client_groups(fed: FederatedData, key: str) -> Tensor:
    """``fed.extras[key]``: the group of every client (Omniglot: ``"alphabet"``), as ``[num_clients]`` longs."""
    if key not in fed.extras:
        raise ConfigError(
            f"ClientEmbedding(group={key!r}) needs extras[{key!r}] (each client's group, e.g. Omniglot's alphabet); "
            f"this datamodule provides {sorted(fed.extras) or 'no extras'}"
        )
    groups = fed.extras[key].long()
    if groups.shape != (fed.num_clients,):
        raise ConfigError(f"extras[{key!r}] has shape {tuple(groups.shape)}, expected [{fed.num_clients}]")
    return groups


class ClientEmbedding(SideInfo):
    """Omniglot's side information (spec 002 §2.5): train ``network`` centrally on every client's training
    samples to predict their group, then ``z_m`` = mean of ``network.body(x)`` over client m's training images.

    Args:
        group: the ``extras`` entry with each client's group; its samples are labelled with it (Omniglot:
            ``alphabet``, a 50-way classifier; every client holds one alphabet).
        network: a ``SplitModel`` whose head outputs one logit per group; ``None`` builds
            ``ConvNet4(num_groups, channels, image size, width)`` (256-d embedding for 1×32×32 and width 64).
        epochs, lr, momentum, batch_size: the central SGD (the paper does not give them; our choice).
        width: channel width of the default network.
        normalize: scale every ``z_m`` to unit norm.
        eval_mode: embed with BatchNorm in eval mode (running statistics).
    """

    def __init__(
        self,
        group: str = "alphabet",
        network: SplitModel | None = None,
        epochs: int = 5,
        lr: float = 0.05,
        momentum: float = 0.5,
        batch_size: int = 64,
        width: int = 64,
        normalize: bool = False,
        eval_mode: bool = True,
    ) -> None:
        if epochs < 0 or lr <= 0 or batch_size < 1:
            raise ConfigError("ClientEmbedding needs epochs ≥ 0, lr > 0 and batch_size ≥ 1")
        self.group, self.network, self.epochs, self.lr, self.momentum = group, network, epochs, lr, momentum
        self.batch_size, self.width, self.normalize, self.eval_mode = batch_size, width, normalize, eval_mode
        self.train_accuracy = float("nan")
        self.trained_network: SplitModel | None = None

    def build_network(self, fed: FederatedData, num_groups: int) -> SplitModel:
        if self.network is not None:
            return self.network
        from fl_lightning.models.perfedsi import ConvNet4

        x = fed.train.x
        return ConvNet4(num_groups, in_channels=x.shape[1], image_size=x.shape[-1], width=self.width)

    def __call__(self, fed, rng):
        x, owners = fed.train.x, fed.train.client_ids()
        labels = client_groups(fed, self.group).to(owners.device)[owners]
        seed = int(rng.integers(2**62))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = self.build_network(fed, int(labels.max()) + 1).to(x.device)
        g = torch.Generator().manual_seed(seed)
        opt = torch.optim.SGD(net.parameters(), lr=self.lr, momentum=self.momentum)
        net.train()
        for _ in range(self.epochs):
            perm = torch.randperm(x.shape[0], generator=g).to(x.device)
            for i in range(0, x.shape[0], self.batch_size):
                idx = perm[i : i + self.batch_size]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(net(x[idx]), labels[idx]).backward()
                opt.step()
        net.train(not self.eval_mode)
        self.trained_network = net
        with torch.no_grad():
            emb = torch.cat([net.body(x[i : i + 1024]) for i in range(0, x.shape[0], 1024)]).flatten(1)
            self.train_accuracy = float((net.head(emb).argmax(-1) == labels).float().mean())
        z = torch.zeros(fed.num_clients, emb.shape[1], device=emb.device).index_add_(0, owners, emb)
        z = z / fed.train.sizes.clamp(min=1).unsqueeze(1).to(z)
        return F.normalize(z, dim=1) if self.normalize else z


class NoisySideInfo(SideInfo):
    """``z_m + std·ε_m`` with ``ε_m ~ N(0, I)`` drawn once per client (noisy side information)."""

    def __init__(self, base: SideInfo, std: float = 0.1) -> None:
        if std < 0:
            raise ConfigError(f"NoisySideInfo.std must be ≥ 0, got {std}")
        self.base, self.std = base, std

    def __call__(self, fed, rng):
        z = self.base(fed, rng)
        return z + self.std * torch.as_tensor(rng.standard_normal(tuple(z.shape)), dtype=z.dtype, device=z.device)


class MissingSideInfo(SideInfo):
    """A random ``fraction`` of clients has no side information: their ``z_m`` is ``zeros`` or the ``mean``
    of the other clients' ``z``."""

    def __init__(self, base: SideInfo, fraction: float = 0.2, fill: Literal["zeros", "mean"] = "zeros") -> None:
        if not 0 <= fraction <= 1:
            raise ConfigError(f"MissingSideInfo.fraction must be in [0, 1], got {fraction}")
        if fill not in ("zeros", "mean"):
            raise ConfigError(f"MissingSideInfo.fill must be 'zeros' or 'mean', got {fill!r}")
        self.base, self.fraction, self.fill = base, fraction, fill

    def __call__(self, fed, rng):
        z = self.base(fed, rng).clone()
        n = z.shape[0]
        missing = torch.as_tensor(rng.permutation(n)[: int(round(self.fraction * n))], dtype=torch.long)
        if missing.numel():
            present = torch.ones(n, dtype=torch.bool)
            present[missing] = False
            value = z[present].mean(0) if self.fill == "mean" and present.any() else torch.zeros_like(z[0])
            z[missing] = value
        return z


class SideInfoDataModule(FederatedDataModule):
    """``base``'s clients, optionally feature-shifted, with side information ``side`` attached.

    Sampling, seed, client count and validation split (``base``'s ``val_fraction``) are ``base``'s; the
    shift applies to every split and the side information sees only the training rows. Models without a
    side branch ignore ``side``, so one datamodule serves PerFedSI and its baselines.

    Args:
        base: any ``FederatedDataModule`` (use ``datamodules.IIDSplit`` as its partition for PerFedSI's CIFAR).
        side: the side-information provider (``None``: no side tensor).
        shift: a ``FeatureShift`` applied per client after ``base`` is built.
    """

    def __init__(
        self, base: FederatedDataModule, side: SideInfo | None = None, shift: FeatureShift | None = None
    ) -> None:
        super().__init__(base.num_clients, base.clients_per_round, None, base.seed)
        self.base, self.side, self.shift = base, side, shift

    def prepare(self, fed: FederatedData) -> FederatedData:
        """Hook between ``base.build()`` and the shift (e.g. resizing)."""
        return fed

    def build(self) -> FederatedData:
        self.base.setup("fit")
        fed = self.prepare(self.base.federated)
        if self.shift is not None:
            fed = self.shift.apply(fed, self.shift.assign_groups(fed.num_clients, self.rng(70_001)))
        if self.side is not None:
            z = self.side(fed, self.rng(70_002))
            if z.shape[0] != fed.num_clients or z.dim() != 2:
                raise ConfigError(
                    f"{type(self.side).__name__} gave side information of shape {tuple(z.shape)}, "
                    f"expected [{fed.num_clients}, dim]"
                )
            fed = replace(fed, side=z.float())
        return fed
