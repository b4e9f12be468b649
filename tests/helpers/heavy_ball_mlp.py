"""References for FedBN, FedBABU, FedRoD and FedALA on small networks: heavy-ball local SGD in plain torch, an MLP's
features and forward from a parameter dict, evaluation scores and weighted means, a BatchNorm network (``TinyBN``),
a short digits fit, and the methods' names and one-line errors for the config runs."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models.split import SplitModel
from tests.helpers.functional_mlp import HeavyBall as TorchSGD
from tests.helpers.training import make_trainer

LR, MOM, FULL_BATCH = 0.05, 0.5, 10_000


TOL = dict(rtol=2e-4, atol=2e-5)  # float32 network; the engine sums uploads in float64


class HeavyBall(TorchSGD):
    """torch.optim.SGD(momentum=μ) written out (no weight decay) at this module's lr and μ."""

    def __init__(self, lr: float = LR, mu: float = MOM) -> None:
        super().__init__(lr, mu)


def grads(loss: torch.Tensor, p: dict, names: list[str]) -> dict:
    return dict(zip(names, torch.autograd.grad(loss, [p[n] for n in names])))


def leaves(p: dict, names: list[str]) -> dict:
    return {**p, **{n: p[n].detach().clone().requires_grad_(True) for n in names}}


def digits(num_clients: int = 5, **kw) -> DigitsDataModule:
    return DigitsDataModule(num_clients=num_clients, partition=Shards(2), participation=1.0, seed=0, **kw)


def fit(algorithm, network, rounds: int, **module_kw) -> tuple[FederatedModule, DigitsDataModule, dict]:
    """Train with every client every round, full-batch momentum SGD; returns the module, data and initial model."""
    dm = digits()
    kw = dict(lr=LR, momentum=MOM, batch_size=FULL_BATCH, eval_every=1, eval_last=1) | module_kw
    module = FederatedModule(algorithm, network, **kw)
    init = {n: t.detach().clone() for n, t in module.global_params().items()}
    make_trainer(rounds).fit(module, datamodule=dm)
    return module, dm, init


def weighted_mean(models: list[dict], sizes: list[int], names: list[str]) -> dict:
    total = sum(sizes)
    return {n: sum(s * m[n] for m, s in zip(models, sizes)) / total for n in names}


def scores(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross entropy) of one client's test logits."""
    return float((logits.argmax(-1) == y).double().mean()), float(F.cross_entropy(logits, y))


def assert_evaluation(module: FederatedModule, expected: list[tuple[float, float]]) -> None:
    result = module.last_evaluation
    for c, (acc, loss) in enumerate(expected):
        assert float(result.acc_per_client[c]) == pytest.approx(acc, abs=1e-9), c
        assert float(result.loss_per_client[c]) == pytest.approx(loss, rel=1e-4), c


def far(a: dict, b: dict, names: list[str]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


# ---- FedBN --------------------------------------------------------------------------------------------------------
class TinyBN(SplitModel):
    """64 → fc 6 → BatchNorm1d → tanh → head 10 (full batches, so BatchNorm1d always sees many samples)."""

    def __init__(self) -> None:
        body = nn.Sequential(
            OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(64, 6), bn=nn.BatchNorm1d(6), act=nn.Tanh())
        )
        super().__init__(body, nn.Linear(6, 10))


# ---- FedBABU ------------------------------------------------------------------------------------------------------
MLP = ["body.fc1.weight", "body.fc1.bias", "head.weight", "head.bias"]


BODY, HEAD = MLP[:2], MLP[2:]


def mlp_forward(p: dict, x: torch.Tensor, head: str = "head.") -> torch.Tensor:
    """DigitsMLP(hidden=(16,)) by hand: relu(x W₁ᵀ + b₁) W_hᵀ + b_h."""
    return mlp_features(p, x) @ p[head + "weight"].T + p[head + "bias"]


def mlp_features(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ p["body.fc1.weight"].T + p["body.fc1.bias"])


def local_sgd(p: dict, names: list[str], x, y, epochs: int) -> dict:
    opt = HeavyBall()
    for _ in range(epochs):
        q = leaves(p, names)
        p = opt.step(p, grads(F.cross_entropy(mlp_forward(q, x), y), q, names))
    return p


METHODS = ["fedbn", "fedbabu", "fedrod", "fedala"]


def error_line(captured: str) -> str:
    """The one ``error:`` line of a failed run (and no traceback)."""
    lines = [ln for ln in captured.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured, captured[-2000:]
    return lines[0]
