"""A phase's minibatches for stacked clients, drawn before its first step (``plan_phase``): every client's epochs from
its own generator as the sequential loop draws them, padded and masked so that step ``s`` of every client runs
together, moved to the device in one copy (no host sync inside a phase).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fl_lightning.client import (
    Gradient,
    MaxSteps,
    Objective,
    Penalty,
)
from fl_lightning.engine.sequential import (
    epoch_draws,
    step_limit,
    steps_per_epoch,
    to_device,
)


# ---- a phase's minibatches, drawn before its first step ------------------------------------------------------
@dataclass
class PhasePlan:
    """Every step of one ``sgd`` phase for ``K`` clients: ``rows[s, k]`` are the data rows of client ``k``'s
    ``s``-th minibatch (``-1``: padding), ``draws[s, k]`` their augmentation draws, ``steps[k]`` how many steps
    client ``k`` takes. Built on the host from the clients' generators, moved to the device in one copy;
    ``host_steps[k]`` and ``lengths[k][s]`` (the real rows of each minibatch, padding after them) stay on the
    host."""

    rows: Tensor
    draws: Tensor | None
    steps: Tensor
    host_steps: list[int]
    lengths: list[list[int]]
    #: the step at which each client's last epoch (with a step) begins, on the host and on the device (``[K]``)
    host_last_epoch: list[int] = field(default_factory=list)
    last_epoch: Tensor | None = None

    @property
    def num_steps(self) -> int:
        return self.rows.shape[0]


def plan_phase(
    sizes: Sequence[int],
    offsets: Sequence[int],
    generators: Sequence[torch.Generator],
    budgets: Sequence[float],
    augment: Callable | None,
    epochs: int,
    batch_size: int,
    min_batch: int,
    max_steps: int | None | Sequence[int | None],
    device: torch.device,
) -> PhasePlan:
    """The draws ``ClientContext.sgd`` makes, for every client: per epoch entered, one ``epoch_draws`` (shuffle and
    augmentation), then its minibatches in order, the last one skipped if it has fewer than ``min_batch`` samples,
    up to the client's step limit (``max_steps``: one for all, or one per client). Step ``s`` of every client is row
    ``s`` of the plan."""
    per_client: list[tuple[list[Tensor], list[Tensor]]] = []
    steps: list[int] = []
    lengths: list[list[int]] = []
    last_epoch: list[int] = []
    caps = list(max_steps) if isinstance(max_steps, Sequence) else [max_steps] * len(sizes)
    for n, start, g, budget, cap in zip(sizes, offsets, generators, budgets, caps):
        limit = step_limit(budget, epochs, n, batch_size, cap, min_batch)
        per_epoch = steps_per_epoch(n, batch_size, min_batch)
        rows, draws, taken = [], [], 0
        lengths.append([])
        last_epoch.append(0)
        for _ in range(epochs):
            if limit is not None and taken >= limit:
                break
            perm, drawn = epoch_draws(n, g, augment)
            take = per_epoch if limit is None else min(per_epoch, limit - taken)
            if take:
                last_epoch[-1] = taken
                used = min(n, per_epoch * batch_size)
                padded = torch.full((per_epoch * batch_size,), -1, dtype=torch.long)
                padded[:used] = perm[:used] + start
                rows.append(padded.view(per_epoch, batch_size)[:take])
                lengths[-1] += [min(batch_size, used - i * batch_size) for i in range(take)]
                if drawn is not None:
                    d = drawn.new_zeros(per_epoch * batch_size, *drawn.shape[1:])
                    d[:used] = drawn[:used]
                    draws.append(d.view(per_epoch, batch_size, *drawn.shape[1:])[:take])
            taken += take
        per_client.append((rows, draws))
        steps.append(taken)
    total = max(steps, default=0)
    # columns: the longest real minibatch of any client (a batch size above every client's data pads no further)
    cols = max((n for client in lengths for n in client), default=batch_size)
    first_draws = next((draws[0] for _, draws in per_client if draws), None)  # a client with no step draws none
    width = 1 + (first_draws[0, 0].numel() if first_draws is not None else 0)
    packed = torch.zeros(total, len(sizes), cols, width, dtype=torch.long)
    packed[..., 0] = -1  # padding rows (their draws stay 0: any valid draw, masked out of the loss)
    for k, (rows, draws) in enumerate(per_client):
        if rows:
            packed[: steps[k], k, :, 0] = torch.cat(rows)[:, :cols]
        if draws:
            packed[: steps[k], k, :, 1:] = torch.cat(draws)[:, :cols].reshape(steps[k], cols, -1)
    k = len(sizes)
    packed = torch.cat([packed.reshape(-1), torch.tensor(steps + last_epoch, dtype=torch.long)])
    packed = to_device(packed, device)  # the phase's only host-to-device transfer
    body, tail = packed[: -2 * k].view(total, k, cols, width), packed[-2 * k :]
    rows, draws = body[..., 0], body[..., 1:] if width > 1 else None
    return PhasePlan(rows, draws, tail[:k], steps, lengths, last_epoch, tail[k:])


@dataclass
class Phase:
    """One ``sgd`` call's arguments (``VectorizedContext.sgd``)."""

    trainable: list[str]
    epochs: int
    penalty: Penalty | None
    lr: float
    max_steps: MaxSteps
    gradient: Gradient | None
    bs: int
    min_batch: int
    objective: Objective | None


def masked_mean(per: Tensor, mask: Tensor) -> Tensor:
    """The mean of per-sample values over the real rows of a padded batch (padding rows never enter, even when
    their value is not finite)."""
    return torch.where(mask > 0, per, 0.0).sum() / mask.sum().clamp(min=1)
