"""Shared by the linear-representation tests: seeded generators, the principal-angle distance in numpy, and the
synthetic linear data the engine and the batched path both train on."""

from __future__ import annotations

import numpy as np
import torch

from datamodules import SyntheticLinearDataModule

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def np_dist(b_star: np.ndarray, b: np.ndarray) -> float:
    q = np.linalg.qr(b)[0]
    return float(np.linalg.svd((np.eye(len(b)) - b_star @ b_star.T) @ q, compute_uv=False)[0])


def engine_data(n: int, d: int, k: int, m: int, noise: float = 1e-3, participation: float = 1.0):
    dm = SyntheticLinearDataModule(n, d, k, m, 10, noise, participation=participation, seed=0)
    dm.setup()
    fed = dm.federated
    x, y = fed.train.x.double().reshape(1, n, m, d), fed.train.y.double().reshape(1, n, m)
    return dm, fed, x, y
