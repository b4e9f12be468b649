"""What a client does locally: functional forward passes and SGD phases over chosen parameters.

A client never gets a model copy. It holds a dict ``name -> tensor`` (parameters and buffers) and
runs the one shared network skeleton with ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

Params = dict[str, Tensor]
Penalty = Callable[[Params], Tensor]


@dataclass
class ClientOptimizer:
    """Local SGD settings (spec 000 §3.2: lr 0.01, momentum 0.5, batch 10)."""

    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    batch_size: int = 10
    decay_bias: bool = True  # False: weight decay on weights only, as the FedRep authors' code does


def select(names: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    """Names that start with any of ``prefixes`` (``""`` selects everything)."""
    return [n for n in names if any(n.startswith(p) for p in prefixes)]


def loss_fn_for(num_classes: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy for classification, ½·MSE for regression (spec 000 eq. 5)."""
    if num_classes is None:
        return lambda out, y: 0.5 * F.mse_loss(out, y)
    return F.cross_entropy


def step_limit(budget: float, epochs: int, num_samples: int, batch_size: int, max_steps: int | None) -> int | None:
    """The number of local steps a client may take: ``max_steps``, capped for a straggler with ``budget`` < 1
    at that fraction of its ``epochs`` epochs of minibatches (at least one step)."""
    if budget >= 1.0:
        return max_steps
    cap = max(1, int(budget * epochs * -(-num_samples // batch_size)))
    return cap if max_steps is None else min(max_steps, cap)


class ClientContext:
    """A client's data, RNG and local optimiser for one round, plus the SGD phase primitive.

    ``generator`` is seeded from ``(seed, round, client)``, so a client's local update does not depend
    on which process runs it or on what ran before it.
    """

    def __init__(
        self,
        net: nn.Module,
        client: int,
        x: Tensor,
        y: Tensor,
        side: Tensor | None,
        optimizer: ClientOptimizer,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        generator: torch.Generator,
        augment: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        round_idx: int = 0,
        seed: int = 0,
        step_budget: float = 1.0,
        channels_last: bool = False,
    ) -> None:
        self.net, self.client, self.x, self.y, self.side = net, client, x, y, side
        self.optimizer, self.loss_fn, self.generator, self.augment = optimizer, loss_fn, generator, augment
        self.round, self.seed, self.step_budget = round_idx, seed, step_budget
        self.channels_last = channels_last  # conv speed-up used by the vectorized executor; same values
        self.param_names = [n for n, p in net.named_parameters() if p.requires_grad]  # frozen ones never train
        self.train_loss = 0.0

    def params_with(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names under ``prefixes``."""
        return select(self.param_names, prefixes)

    def params_without(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names not under ``prefixes``."""
        chosen = set(select(self.param_names, prefixes))
        return [n for n in self.param_names if n not in chosen]

    @property
    def num_samples(self) -> int:
        return self.x.shape[0]

    def side_for(self, n: int) -> Tensor | None:
        return None if self.side is None else self.side.expand(n, *self.side.shape)

    def forward(self, params: Params, x: Tensor) -> Tensor:
        return functional_call(self.net, params, (x,), {"side": self.side_for(x.shape[0])}, strict=False)

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        return self.loss_fn(self.forward(params, x), y)

    def batches(self, batch_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled minibatches (augmented if the data have an on-device augmentation)."""
        bs = batch_size or self.optimizer.batch_size
        perm = torch.randperm(self.num_samples, generator=self.generator).to(self.x.device)
        for i in range(0, self.num_samples, bs):
            idx = perm[i : i + bs]
            x = self.x[idx]
            if self.augment is not None:
                x = self.augment(x, self.generator)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, self.y[idx]

    def sgd(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: Penalty | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
    ) -> Params:
        """Train ``trainable`` for ``epochs`` epochs of minibatch SGD; everything else stays frozen.

        A fresh optimiser per phase, so no momentum or weight decay leaks into frozen parameters
        (spec 000 §8.3). ``penalty(params)`` is added to every minibatch loss (FedProx, Ditto, …).
        Returns a new dict; ``params`` is not modified.
        """
        out = {n: t.detach().clone() for n, t in params.items()}
        if self.channels_last:
            out = {n: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for n, t in out.items()}
        if not trainable or epochs <= 0:
            return out
        leaves = {n: out[n].requires_grad_(True) for n in trainable}
        decay = self.optimizer.weight_decay
        groups = [
            {"params": [v for n, v in leaves.items() if self.optimizer.decay_bias or not n.endswith("bias")]},
            {"params": [v for n, v in leaves.items() if not self.optimizer.decay_bias and n.endswith("bias")]},
        ]
        groups[0]["weight_decay"], groups[1]["weight_decay"] = decay, 0.0
        opt = torch.optim.SGD(
            [g for g in groups if g["params"]],
            lr=self.optimizer.lr if lr is None else lr,
            momentum=self.optimizer.momentum,
        )
        max_steps = step_limit(self.step_budget, epochs, self.num_samples, self.optimizer.batch_size, max_steps)
        steps, loss_sum = 0, 0.0
        for _ in range(epochs):
            for x, y in self.batches():
                opt.zero_grad(set_to_none=True)
                loss = self.loss(out, x, y)
                if penalty is not None:
                    loss = loss + penalty(out)
                loss.backward()
                opt.step()
                loss_sum += float(loss.detach())
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
            if max_steps is not None and steps >= max_steps:
                break
        self.train_loss = loss_sum / max(steps, 1)
        return {n: t.detach() for n, t in out.items()}

    @torch.no_grad()
    def mean_loss(self, params: Params) -> float:
        return float(self.loss(params, self.x, self.y)) if self.num_samples else 0.0
