"""A CIFAR-10 DataModule on test-written files and the repository root, for the partition and config tests."""

from __future__ import annotations

from pathlib import Path

from datamodules import (  # noqa: E402
    CIFAR10DataModule,
    Shards,
)

ROOT = Path(__file__).resolve().parents[2]


# ---- hash and report ------------------------------------------------------------------------------------
def cifar_dm(root: Path, seed: int, **kw) -> CIFAR10DataModule:
    return CIFAR10DataModule(num_clients=10, partition=Shards(2), data_dir=str(root), seed=seed, **kw)
