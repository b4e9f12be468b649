"""Synthetic multi-task linear regression (spec 000 §3.1, §5): y = wᵢ*ᵀ B*ᵀ x + noise.

x ~ N(0, I_d); B* is the Q factor of a Gaussian d×k matrix; W* rows are Gaussian rows rescaled to norm
√k (Assumption A3; the spec's "A3 literally" choice); train labels carry Gaussian noise of variance
``noise_variance`` (the paper's N(·, 10⁻³) read as a variance); test labels are noise-free.
Ground truth is exposed as ``federated.extras["B_star"]`` and ``["W_star"]``.
"""

from __future__ import annotations

import torch

from datamodules.base import FederatedDataModule
from fl_lightning.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError


def linear_ground_truth(
    num_clients: int, dim: int, rank: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    b_star, _ = torch.linalg.qr(torch.randn(dim, rank, generator=generator, dtype=torch.float64))
    w_star = torch.randn(num_clients, rank, generator=generator, dtype=torch.float64)
    w_star = w_star / w_star.norm(dim=1, keepdim=True) * rank**0.5
    return b_star, w_star


class SyntheticLinearDataModule(FederatedDataModule):
    def __init__(
        self,
        num_clients: int = 100,
        dim: int = 10,
        rank: int = 2,
        samples_per_client: int = 5,
        test_samples_per_client: int = 50,
        noise_variance: float = 1e-3,
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed)
        if rank > dim or rank < 1:
            raise ConfigError(f"SyntheticLinearDataModule: need 1 ≤ rank ≤ dim, got rank={rank}, dim={dim}")
        if samples_per_client < 1:
            raise ConfigError(f"samples_per_client must be ≥ 1, got {samples_per_client}")
        self.dim, self.rank = dim, rank
        self.samples_per_client, self.test_samples_per_client = samples_per_client, test_samples_per_client
        self.noise_variance = noise_variance

    def build(self) -> FederatedData:
        g = torch.Generator().manual_seed(self.resolved_seed)
        n, d, m, mt = self.num_clients, self.dim, self.samples_per_client, self.test_samples_per_client
        b_star, w_star = linear_ground_truth(n, d, self.rank, g)
        theta = (w_star @ b_star.T).float()  # row i = (B* wᵢ*)ᵀ

        def draw(per_client: int, noise_var: float) -> ClientSplit:
            x = torch.randn(n, per_client, d, generator=g)
            y = torch.einsum("npd,nd->np", x, theta)
            y = y + noise_var**0.5 * torch.randn(n, per_client, generator=g)
            ptr = torch.arange(n + 1) * per_client
            return ClientSplit(x.reshape(n * per_client, d), y.reshape(-1), ptr)

        train, test = draw(m, self.noise_variance), draw(mt, 0.0)
        return FederatedData(
            train, test, None, seed=self.resolved_seed, extras={"B_star": b_star.float(), "W_star": w_star.float()}
        )
