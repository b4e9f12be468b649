"""Client data builders shared by the unit tests."""

from __future__ import annotations

import torch

from fl_lightning.engine.client_data import ClientSplit


def ranged_client_split(rows: list[int], features: int, classification: bool) -> ClientSplit:
    """Client c owns ``rows[c]`` rows of ``features`` float features (``arange / 100``); integer labels
    (``row % 10``) or float targets (``linspace(0, 1)``)."""
    n = sum(rows)
    x = torch.arange(n * features, dtype=torch.float32).reshape(n, features) / 100.0
    y = torch.arange(n) % 10 if classification else torch.linspace(0.0, 1.0, n)
    ptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    return ClientSplit(x, y, ptr)
