"""``FederatedDataModule.test_dataloader`` splits the clients over the trainer's ranks like validation does:
rank r evaluates the clients c ≡ r (mod world); the ranks together cover every client exactly once."""

from __future__ import annotations

from types import SimpleNamespace

from datamodules import DigitsDataModule


def clients_of(loader) -> list[int]:
    return [c for chunk in loader for c in chunk]


def test_test_clients_are_split_over_ranks() -> None:
    num_clients, world = 7, 3
    seen: list[int] = []
    for rank in range(world):
        dm = DigitsDataModule(num_clients=num_clients)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world, max_steps=1)
        test, val = clients_of(dm.test_dataloader()), clients_of(dm.val_dataloader())
        assert test == [c for c in range(num_clients) if c % world == rank] == val
        seen += test
    assert sorted(seen) == list(range(num_clients))
