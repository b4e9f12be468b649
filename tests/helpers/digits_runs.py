"""The bundled digits data for short engine runs, and a variant with held-out new clients (given to the CLI by its
class path ``tests.helpers.digits_runs.DigitsWithNewClients``)."""

from __future__ import annotations

from datamodules import DigitsDataModule, Shards


def digits(num_clients=20, **kw):
    return DigitsDataModule(num_clients=num_clients, partition=Shards(2 if num_clients > 1 else 10), seed=0, **kw)


class DigitsWithNewClients(DigitsDataModule):
    """Digits with 5 held-out clients (another partition seed) that never train (FedRep Fig. 6-style), as
    ``new_clients``."""

    def setup(self, stage=None):
        super().setup(stage)
        other = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
        other.setup()
        self.new_clients = other.federated
