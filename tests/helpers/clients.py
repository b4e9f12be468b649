"""Client builders shared by the unit tests: client data (``ranged_client_split``) and a client's context
(``client_context``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.client_data import ClientSplit
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext


def ranged_client_split(rows: list[int], features: int, classification: bool) -> ClientSplit:
    """Client c owns ``rows[c]`` rows of ``features`` float features (``arange / 100``); integer labels
    (``row % 10``) or float targets (``linspace(0, 1)``)."""
    n = sum(rows)
    x = torch.arange(n * features, dtype=torch.float32).reshape(n, features) / 100.0
    y = torch.arange(n) % 10 if classification else torch.linspace(0.0, 1.0, n)
    ptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return ClientSplit(x, y, ptr)


def client_context(
    net: torch.nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    loss: Callable[[Tensor, Tensor], Tensor] | None = None,
    optimizer: ClientOptimizer | None = None,
    generator: torch.Generator | None = None,
    client: int = 0,
    side: Tensor | None = None,
    **settings: Any,
) -> ClientContext:
    """One client's ``ClientContext`` from keywords, the one place the tests spell out its constructor: a fresh
    ``ClientOptimizer()`` and ``make_generator(0)`` unless given, no loss (closed-form methods) unless given;
    ``settings`` are the constructor's remaining keywords (``round_idx``, ``seed``, ``step_budget``, ...)."""
    optimizer = ClientOptimizer() if optimizer is None else optimizer
    generator = make_generator(0) if generator is None else generator
    return ClientContext(net, client, x, y, side, optimizer, loss, generator, **settings)
