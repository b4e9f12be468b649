"""The bundled digits data for short engine runs."""

from __future__ import annotations

from datamodules import DigitsDataModule, Shards


def digits(num_clients=20, **kw):
    return DigitsDataModule(num_clients=num_clients, partition=Shards(2 if num_clients > 1 else 10), seed=0, **kw)
