"""Synthetic multi-task linear regression (spec 000 §3.1, §5; spec 004 §4.1): y = wᵢ*ᵀ B*ᵀ x + noise.

x ~ N(0, I_d); B* is the Q factor of a Gaussian d×k matrix; the heads wᵢ* (rows of W*) are drawn by ``heads``:

* ``fixed_norm`` (default, spec 000 Assumption A3 read literally): Gaussian rows rescaled to norm ``head_norm``
  (default √k);
* ``gaussian`` (spec 004 §4.1): wᵢ* ~ N(0, I_k);
* ``qr`` (spec 000 App. A.1 read literally): the Q factor of a Gaussian n×k matrix, times ``head_norm`` (√k).

Training labels carry Gaussian noise of variance ``noise_variance`` (spec 000's N(·, 10⁻³) read as a variance);
test labels carry ``test_noise_variance`` (the papers: none). Every client keeps its m samples for all rounds.

Ground truth, in float64, is in ``federated.extras``: ``B_star`` [d, k], ``W_star`` [n, k] and
``population_target`` [n, d] whose row i is θᵢ* = B*wᵢ* = E[x y] of client i, so that client i's population loss
is ½‖Bw − θᵢ*‖² + const (what ``gradient: population`` of ``LinearFedAvg``/``LinearFedRep`` differentiates).

New clients (``new_clients`` > 0, spec 004 §2.3 / spec 000 Fig. 4) never train: each has
``new_client_samples`` training samples with noise variance ``new_client_noise_variance`` and a head drawn by
``new_client_heads``; its test split is the exact population design x = √d·eⱼ (j = 1..d), y = ⟨θ*, x⟩, whose
mean squared error is exactly ‖B̂ŵ − θ*‖² (the metric of spec 004 Fig. 3, right). They are drawn from their own
random stream, so adding them does not change the training clients.

Every argument with its paper value and source: docs/generators.md.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError

Heads = Literal["fixed_norm", "gaussian", "qr"]


def linear_ground_truth(
    num_clients: int,
    dim: int,
    rank: int,
    generator: torch.Generator,
    heads: Heads = "fixed_norm",
    head_norm: float | None = None,
) -> tuple[Tensor, Tensor]:
    """B* (d×k, orthonormal) and W* (n×k, rows wᵢ*) in float64; ``heads`` as in the module docstring."""
    b_star, _ = torch.linalg.qr(torch.randn(dim, rank, generator=generator, dtype=torch.float64))
    w_star = torch.randn(num_clients, rank, generator=generator, dtype=torch.float64)
    norm = rank**0.5 if head_norm is None else head_norm
    if heads == "fixed_norm":
        w_star = w_star / w_star.norm(dim=1, keepdim=True) * norm
    elif heads == "qr":
        w_star = torch.linalg.qr(w_star)[0] * norm
    return b_star, w_star


def population_design(theta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Exact population split of clients with regressors ``theta`` [n, d]: x = √d·eⱼ (j = 1..d), y = ⟨θ, x⟩.

    (1/d)XᵀX = I and (1/d)Xᵀy = θ, so the mean squared error of a prediction vector v is ‖v − θ‖² =
    E_{x~N(0,I)}[(⟨v − θ, x⟩)²]. Returns x [n·d, d], y [n·d] and ptr."""
    n, d = theta.shape
    x = (d**0.5 * torch.eye(d, dtype=theta.dtype)).repeat(n, 1)
    y = d**0.5 * theta.reshape(-1)
    return x, y, torch.arange(n + 1) * d


class SyntheticLinearDataModule(FederatedDataModule):
    """The papers' multi-task linear regression generator; every constant is an argument (module docstring).

    Args:
        num_clients, dim, rank: n, d, k (spec 000 Fig. 3: 100 of {10, 100, 1000}, 10, 2).
        samples_per_client: m, fixed training samples per client (Fig. 3: 5).
        test_samples_per_client: noise-free test samples per client.
        noise_variance: variance of the training-label noise (spec 000: 10⁻³).
        test_noise_variance: variance of the test-label noise (papers: 0).
        heads: ``fixed_norm`` | ``gaussian`` | ``qr`` (spec 000 A3 | spec 004 | spec 000 App. A.1).
        head_norm: ‖wᵢ*‖ for ``fixed_norm`` and the scale of ``qr`` (default √k).
        new_clients: held-out clients that never train (``self.new_clients``), evaluated after fine-tuning.
        new_client_samples: their training samples n (spec 004 Fig. 3 sweeps 5–100).
        new_client_noise_variance: their label-noise variance (spec 004: 0.01).
        new_client_heads: ``gaussian`` (both papers' new clients: N(0, I_k)) or ``fixed_norm``.
        val_fraction: a validation split carved from each client's training samples (``FederatedDataModule``).
    """

    def __init__(
        self,
        num_clients: int = 100,
        dim: int = 10,
        rank: int = 2,
        samples_per_client: int = 5,
        test_samples_per_client: int = 50,
        noise_variance: float = 1e-3,
        test_noise_variance: float = 0.0,
        heads: Heads = "fixed_norm",
        head_norm: float | None = None,
        new_clients: int = 0,
        new_client_samples: int = 20,
        new_client_noise_variance: float = 0.01,
        new_client_heads: Literal["gaussian", "fixed_norm"] = "gaussian",
        clients_per_round: int | None = None,
        participation: float | None = 0.1,
        seed: int | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__(num_clients, clients_per_round, participation, seed, val_fraction)
        name = "SyntheticLinearDataModule"
        if rank > dim or rank < 1:
            raise ConfigError(f"{name}: need 1 ≤ rank ≤ dim, got rank={rank}, dim={dim}")
        if samples_per_client < 1 or test_samples_per_client < 0:
            raise ConfigError(
                f"{name}: need samples_per_client ≥ 1 and test_samples_per_client ≥ 0, "
                f"got {samples_per_client} and {test_samples_per_client}"
            )
        if min(noise_variance, test_noise_variance, new_client_noise_variance) < 0:
            raise ConfigError(f"{name}: noise variances must be ≥ 0")
        if heads not in ("fixed_norm", "gaussian", "qr") or new_client_heads not in ("fixed_norm", "gaussian"):
            raise ConfigError(f"{name}: unknown heads {heads!r} / new_client_heads {new_client_heads!r}")
        if head_norm is not None and head_norm <= 0:
            raise ConfigError(f"{name}: head_norm must be positive, got {head_norm}")
        if heads == "qr" and num_clients < rank:
            raise ConfigError(f"{name}: heads 'qr' needs num_clients ≥ rank, got {num_clients} < {rank}")
        if new_clients < 0 or (new_clients and new_client_samples < 1):
            raise ConfigError(f"{name}: need new_clients ≥ 0 and new_client_samples ≥ 1")
        self.dim, self.rank = dim, rank
        self.samples_per_client, self.test_samples_per_client = samples_per_client, test_samples_per_client
        self.noise_variance, self.test_noise_variance = noise_variance, test_noise_variance
        self.heads, self.head_norm = heads, head_norm
        self.num_new_clients, self.new_client_samples = new_clients, new_client_samples
        self.new_client_noise_variance, self.new_client_heads = new_client_noise_variance, new_client_heads
        self.new_clients: FederatedData | None = None

    @staticmethod
    def _draw(theta: Tensor, per_client: int, noise_var: float, g: torch.Generator) -> ClientSplit:
        """x ~ N(0, I_d) (float32 draws, kept exactly in float64), y = ⟨θᵢ, x⟩ + noise computed in float64."""
        n, d = theta.shape
        x = torch.randn(n, per_client, d, generator=g).double()
        y = torch.einsum("npd,nd->np", x, theta)
        y = y + noise_var**0.5 * torch.randn(n, per_client, generator=g).double()
        ptr = torch.arange(n + 1) * per_client
        return ClientSplit(x.reshape(n * per_client, d), y.reshape(-1), ptr)

    def build(self) -> FederatedData:
        g = torch.Generator().manual_seed(self.resolved_seed)
        n, d, k = self.num_clients, self.dim, self.rank
        b_star, w_star = linear_ground_truth(n, d, k, g, self.heads, self.head_norm)
        theta = w_star @ b_star.T  # row i = (B* wᵢ*)ᵀ
        train = self._draw(theta, self.samples_per_client, self.noise_variance, g)
        test = self._draw(theta, self.test_samples_per_client, self.test_noise_variance, g)
        if self.num_new_clients:
            self.new_clients = self._build_new_clients(b_star)
        extras = {"B_star": b_star, "W_star": w_star, "population_target": theta}
        return FederatedData(train, test, None, seed=self.resolved_seed, extras=extras)

    def _build_new_clients(self, b_star: Tensor) -> FederatedData:
        g = make_generator(self.resolved_seed, "new-clients")
        count, k = self.num_new_clients, self.rank
        w_new = torch.randn(count, k, generator=g, dtype=torch.float64)
        if self.new_client_heads == "fixed_norm":
            w_new = w_new / w_new.norm(dim=1, keepdim=True) * (k**0.5 if self.head_norm is None else self.head_norm)
        theta = w_new @ b_star.T
        train = self._draw(theta, self.new_client_samples, self.new_client_noise_variance, g)
        test = ClientSplit(*population_design(theta))
        extras = {"B_star": b_star, "W_star": w_new, "population_target": theta}
        return FederatedData(train, test, None, seed=self.resolved_seed, extras=extras)
