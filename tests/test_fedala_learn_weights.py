"""FedALA's weight learning (``FedALA.learn_weights``) on a one-layer linear model with the MSE loss, against the
ALA rule written out in plain torch with the analytic gradient:

    sample s % of the client's rows (at least one) with the client's generator, then per epoch a fresh permutation
    of the sample (same generator) in minibatches of the run's batch size, and per minibatch
    W ← clip(W − η ∇_θ̂ L(θ̂) ⊙ (Θ − θ), 0, 1),    θ̂ = θ + (Θ − θ) ⊙ W.

Pinned: the sample size max(1, ⌊s n / 100⌋), that both permutations come from the client's generator (not the
global RNG), the number of minibatches per epoch (rows, not features), the clip at 0, and the one-row client.
"""

from __future__ import annotations

import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms.fedala import FedALA
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator

D_IN = 3
NAMES = ("head.weight", "head.bias")


class TinyLinear(nn.Module):
    """One linear layer that accepts the ``side`` keyword ``ClientContext.forward`` passes."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D_IN, 1, dtype=torch.float64)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.head(x)


def problem(n: int, seed: int = 0) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Data (n rows), the global model Θ, the local model θ and W (strictly inside (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    glob = {"head.weight": torch.randn(1, D_IN, generator=g, dtype=torch.float64),
            "head.bias": torch.randn(1, generator=g, dtype=torch.float64)}  # fmt: skip
    local = {k: v + torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()}
    weights = {k: 0.3 + 0.4 * torch.rand(v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()}
    return x, y, glob, local, weights


def context(x: Tensor, y: Tensor, batch_size: int, seed: int = 5) -> ClientContext:
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=batch_size)
    return ClientContext(TinyLinear(), 0, x, y, None, opt, F.mse_loss, make_generator(seed, "ala", 0))


def reference(
    x: Tensor, y: Tensor, glob: dict, local: dict, weights: dict, s: float, eta: float, bs: int,
    generator: torch.Generator, epochs: int = 1,
) -> dict[str, Tensor]:  # fmt: skip
    """The ALA rule above, with ∂MSE/∂w = 2/B (ŷ − y)ᵀ x and ∂MSE/∂b = 2/B Σ (ŷ − y)."""
    n = x.shape[0]
    k = max(1, int(s / 100 * n))
    rows = torch.randperm(n, generator=generator)[:k]
    xs, ys = x[rows], y[rows]
    gap = {n_: glob[n_] - local[n_] for n_ in NAMES}
    w = {n_: weights[n_].clone() for n_ in NAMES}
    for _ in range(epochs):
        perm = torch.randperm(k, generator=generator)
        for start in range(0, k, bs):
            idx = perm[start : start + bs]
            xb, yb = xs[idx], ys[idx]
            mixed = {n_: local[n_] + gap[n_] * w[n_] for n_ in NAMES}
            residual = xb @ mixed["head.weight"].T + mixed["head.bias"] - yb  # [B, 1]
            grad = {"head.weight": 2.0 / len(idx) * residual.T @ xb, "head.bias": 2.0 / len(idx) * residual.sum(0)}
            w = {n_: (w[n_] - eta * grad[n_] * gap[n_]).clamp(0.0, 1.0) for n_ in NAMES}
    return w


def run(n: int, s: float, eta: float, bs: int) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """(W from learn_weights, W from the reference, W at the start) for one epoch of ALA."""
    x, y, glob, local, weights = problem(n)
    ctx = context(x, y, bs)
    twin = torch.Generator()
    twin.set_state(ctx.generator.get_state())
    torch.manual_seed(1234)  # the global RNG differs from the client's generator
    got = FedALA(s=s, eta=eta).learn_weights(ctx, glob, local, dict(weights), until_converged=False)
    return got, reference(x, y, glob, local, weights, s, eta, bs, twin), weights


def test_minibatches_over_the_sample_in_the_generators_order_with_the_clip_at_zero():
    """6 of 10 rows (s = 60 %) in 3 minibatches of 2 (3 features, so a loop over features would take 2), a large
    η so that some weights hit the clip at 0 and some at 1."""
    got, want, start = run(n=10, s=60.0, eta=5.0, bs=2)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
    flat = torch.cat([want[name].flatten() for name in NAMES])
    assert (flat == 0.0).any() and (flat == 1.0).any()  # both ends of the clip are exercised
    assert not torch.equal(flat, torch.cat([start[name].flatten() for name in NAMES]))


def test_a_small_percentage_still_takes_exactly_one_row():
    """s = 15 % of 10 rows is ⌊1.5⌋ = 1 row: one minibatch of one row, not two."""
    got, want, start = run(n=10, s=15.0, eta=0.05, bs=4)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
        assert not torch.equal(want[name], start[name])


def test_a_one_row_client_learns_from_its_row():
    got, want, start = run(n=1, s=80.0, eta=0.05, bs=4)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
        assert not torch.equal(want[name], start[name])


def test_a_client_without_rows_keeps_its_weights():
    x, y, glob, local, weights = problem(0)
    got = FedALA().learn_weights(context(x, y, 4), glob, local, weights, until_converged=True)
    for name in NAMES:
        assert torch.equal(got[name], weights[name])


def test_initial_state_of_a_bias_free_top_layer_lives_on_the_models_device():
    """A top layer with one tensor (a bias-free head): θ_i = Θ, W_i = 1 and the round counter 0, all on the model's
    device (``meta`` here, so a counter made on the default device would show)."""
    params = {"body.weight": torch.randn(4, 3), "head.weight": torch.randn(2, 4)}
    state = FedALA(p=1).init_client_state(params)
    assert sorted(state) == ["ala_runs", "ala_w.head.weight", "local.head.weight"]
    assert torch.equal(state["local.head.weight"], params["head.weight"])
    assert torch.equal(state["ala_w.head.weight"], torch.ones(2, 4))
    assert state["ala_runs"].shape == () and state["ala_runs"].dtype == torch.long and int(state["ala_runs"]) == 0
    on_meta = FedALA(p=1).init_client_state({n: t.to("meta") for n, t in params.items()})
    assert on_meta["ala_runs"].device.type == "meta" and on_meta["ala_w.head.weight"].device.type == "meta"
