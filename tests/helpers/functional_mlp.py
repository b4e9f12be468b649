"""A small float64 MLP written as functions of a parameter dict (``NAMES``): its loss and gradient as plain-torch
references, torch's momentum SGD step written out (``HeavyBall``), the ``double_mlp_setup`` fixture of one client with
that network, and a short digits run (``run_digits``); the client-update references of FedProx, SCAFFOLD, Ditto,
APFL, L2GD, Per-FedAvg and Fed-MTL."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.training import make_trainer

NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]


LR, MOM = 0.1, 0.5


def ref_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The tiny network written out by hand: softmax regression on tanh(W₁x + b₁)."""
    h = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
    logits = h @ p["head.weight"].T + p["head.bias"]
    return -(logits.log_softmax(-1).gather(1, y[:, None])).mean()


def ref_grad(p, x, y) -> dict[str, torch.Tensor]:
    leaves = {n: p[n].detach().clone().requires_grad_(True) for n in NAMES}
    grads = torch.autograd.grad(ref_loss(leaves, x, y), [leaves[n] for n in NAMES])
    return dict(zip(NAMES, grads))


class HeavyBall:
    """torch.optim.SGD's step written out: d = g + wd·p (biases excluded when ``decay_bias`` is False),
    b = d at the first step and μb + d after, p ← p − lr·b."""

    def __init__(self, lr: float = LR, mu: float = MOM, wd: float = 0.0, decay_bias: bool = True) -> None:
        self.lr, self.mu, self.wd, self.decay_bias = lr, mu, wd, decay_bias
        self.buf: dict[str, torch.Tensor] = {}

    def step(self, p: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(p)
        for n in g:
            d = g[n] + (self.wd * p[n] if self.decay_bias or not n.endswith("bias") else 0.0)
            self.buf[n] = d if n not in self.buf else self.mu * self.buf[n] + d
            out[n] = p[n] - self.lr * self.buf[n]
        return out


def rand_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"body.0.weight": (3, 4), "body.0.bias": (3,), "head.weight": (2, 3), "head.bias": (2,)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


@pytest.fixture
def double_mlp_setup():
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(3, 2)).double()
    assert [n for n, _ in net.named_parameters()] == NAMES
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])

    def ctx(round_idx: int = 0, lr: float = LR, budget: float = 1.0, **settings) -> ClientContext:
        opt = ClientOptimizer(**{"lr": lr, "momentum": MOM, "batch_size": 100, **settings})  # full batch
        return client_context(
            net, x, y, optimizer=opt, loss=F.cross_entropy, generator=torch.Generator().manual_seed(2),
            round_idx=round_idx, step_budget=budget,
        )

    return ctx, x, y


def close(a, b):
    for n in NAMES:
        assert_close_finite(a[n], b[n], rtol=1e-9, atol=1e-10, msg=n)


# ---- end to end on digits -----------------------------------------------------------------------------------
def run_digits(algorithm, rounds=3, **module_kw):
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
    torch.manual_seed(0)
    module = FederatedModule(algorithm, DigitsMLP(hidden=(16,)), eval_every=100, eval_last=1, **module_kw)
    seen: list[set[str]] = []
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.append(set(t)))

    module.attach_data = attach_and_observe
    make_trainer(rounds).fit(module, datamodule=dm)
    return module, seen
