"""Client data as client-indexed tensors: all samples sorted by client, with CSR offsets.

Client ``c`` owns rows ``ptr[c]:ptr[c+1]`` of ``x``/``y``; a client's data is a zero-copy view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import Tensor

from fl_lightning.errors import ConfigError


def _cast(t: Tensor, device: torch.device | str, dtype: torch.dtype | None) -> Tensor:
    return t.to(device, dtype) if dtype is not None and t.is_floating_point() else t.to(device)


@dataclass
class ClientSplit:
    """One split (train or test) of every client: ``x[ptr[c]:ptr[c+1]]`` belongs to client ``c``."""

    x: Tensor
    y: Tensor
    ptr: Tensor

    @classmethod
    def from_indices(cls, x: Tensor, y: Tensor, indices: Sequence[Tensor]) -> ClientSplit:
        """Gather the per-client index sets of a partition into one client-sorted tensor."""
        sizes = torch.tensor([len(i) for i in indices], dtype=torch.long)
        order = torch.cat([torch.as_tensor(i, dtype=torch.long) for i in indices]) if len(indices) else sizes
        ptr = torch.zeros(len(indices) + 1, dtype=torch.long)
        ptr[1:] = sizes.cumsum(0)
        return cls(x[order], y[order], ptr)

    @property
    def num_clients(self) -> int:
        return self.ptr.numel() - 1

    @property
    def sizes(self) -> Tensor:
        return self.ptr[1:] - self.ptr[:-1]

    @property
    def offsets(self) -> list[int]:
        """``ptr`` on the host (read once, then kept; also by ``to``): slicing a client's rows reads no device."""
        if getattr(self, "_offsets", None) is None:
            self._offsets = self.ptr.tolist()
        return self._offsets

    def host_sizes(self, clients: Sequence[int]) -> list[int]:
        """The training rows of ``clients``, from the host offsets."""
        offsets = self.offsets
        return [offsets[c + 1] - offsets[c] for c in clients]

    def client(self, c: int) -> tuple[Tensor, Tensor]:
        lo, hi = self.offsets[c], self.offsets[c + 1]
        return self.x[lo:hi], self.y[lo:hi]

    def client_ids(self) -> Tensor:
        """The owner of every row: ``[N]``."""
        return torch.repeat_interleave(torch.arange(self.num_clients, device=self.ptr.device), self.sizes)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ClientSplit:
        """Move to ``device``; with ``dtype``, floating ``x``/``y`` are cast too (integer labels, indices stay)."""
        moved = ClientSplit(_cast(self.x, device, dtype), _cast(self.y, device, dtype), self.ptr.to(device))
        moved._offsets = self.offsets
        return moved


@dataclass
class FederatedData:
    """Everything the engine needs from a DataModule.

    ``side`` is the ``[num_clients, dim]`` side-information tensor (never uploaded), ``augment`` a
    batched on-device transform ``(x, generator) -> x`` applied to training batches, ``num_classes``
    is ``None`` for regression. ``extras`` holds ground truth for metrics (e.g. ``B_star``).

    ``val`` (``None`` unless the DataModule's ``val_fraction`` > 0) is a validation split carved from every
    client's training rows (disjoint from ``train``, same class mix), for choosing hyper-parameters without
    touching ``test``; ``evaluation_split("val" | "test")`` is what an evaluation loop should read.
    """

    train: ClientSplit
    test: ClientSplit
    num_classes: int | None
    seed: int = 0
    side: Tensor | None = None
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    val: ClientSplit | None = None

    @property
    def num_clients(self) -> int:
        return self.train.num_clients

    @property
    def task(self) -> str:
        return "regression" if self.num_classes is None else "classification"

    def evaluation_split(self, which: Literal["test", "val"] = "test") -> ClientSplit:
        """The split an evaluation reads: ``test`` (the default) or the validation split carved from training."""
        if which == "test":
            return self.test
        if which != "val":
            raise ConfigError(f"evaluation split must be 'test' or 'val', got {which!r}")
        if self.val is None:
            raise ConfigError("evaluation on 'val' needs a validation split: set data.init_args.val_fraction > 0")
        return self.val

    def map_splits(self, fn: Callable[[ClientSplit], ClientSplit]) -> FederatedData:
        """The same federation with ``fn`` applied to every split (train, test and, if any, val)."""
        return replace(self, train=fn(self.train), test=fn(self.test), val=None if self.val is None else fn(self.val))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> FederatedData:
        """Move to ``device``; with ``dtype``, the floating client data (x, y, side) are cast to it. ``extras``
        (ground truth for metrics) keep their dtype. The copies are normal tensors even when Lightning's evaluation
        loop moves the data (it runs under ``torch.inference_mode``): evaluations adapt and fine-tune on them with
        autograd, which refuses inference tensors."""
        with torch.inference_mode(False):
            return FederatedData(
                self.train.to(device, dtype),
                self.test.to(device, dtype),
                self.num_classes,
                self.seed,
                None if self.side is None else _cast(self.side, device, dtype),
                self.augment,
                {k: v.to(device) for k, v in self.extras.items()},
                None if self.val is None else self.val.to(device, dtype),
            )
