"""Split networks (body/head) and their references: parameter dicts, the forward pass and negative log-likelihood,
reference local SGD, a one-client context fixture (``client``), and a short FedPer run with its metrics.csv."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.models import CifarCNN
from fl_lightning.models.split import SplitModel
from tests.helpers.clients import client_context

ROOT = Path(__file__).resolve().parents[2]


# ---- 1. personal / shared split by parameter name -------------------------------------------------------------
CIFAR_BODY_LOWER = ["body.conv1.weight", "body.conv1.bias", "body.conv2.weight", "body.conv2.bias"]


CIFAR_BODY_UPPER = ["body.fc1.weight", "body.fc1.bias", "body.fc2.weight", "body.fc2.bias"]


CIFAR_HEAD = ["head.weight", "head.bias"]


def cifar_params() -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in CifarCNN().named_parameters()}
    assert list(params) == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER + CIFAR_HEAD  # the names the splits below use
    return params


def split_of(algorithm) -> tuple[list[str], list[str], list[str], list[str]]:
    """(personal, shared, uploaded, client-state) parameter names on the FedRep CIFAR CNN."""
    params = cifar_params()
    return (
        algorithm.personal_names(params),
        algorithm.shared_names(params),
        list(algorithm.upload_template(params)),
        list(algorithm.init_client_state(params)),
    )


# ---- 2. client updates against hand-written references ----------------------------------------------------------
NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]


BODY, HEAD = NAMES[:2], NAMES[2:]


LR, MOMENTUM = 0.2, 0.5


def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The tiny network written out: logits = W₂ tanh(W₁x + b₁) + b₂."""
    return torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"]) @ p["head.weight"].T + p["head.bias"]


def nll(p, x, y):
    return -(forward(p, x).log_softmax(-1).gather(1, y[:, None])).mean()


def reference_sgd(p, x, y, trainable, steps, penalty=None, lr=LR, momentum=MOMENTUM):
    """Full-batch SGD with heavy-ball momentum (v ← μv + g, w ← w − ηv; a fresh v per call) on ``trainable``."""
    p = {n: t.clone() for n, t in p.items()}
    v = {n: torch.zeros_like(p[n]) for n in trainable}
    for _ in range(steps):
        leaves = {n: t.clone().requires_grad_(n in trainable) for n, t in p.items()}
        loss = nll(leaves, x, y) + (penalty(leaves) if penalty else 0.0)
        grads = torch.autograd.grad(loss, [leaves[n] for n in trainable])
        for n, g in zip(trainable, grads):
            v[n] = momentum * v[n] + g
            p[n] = p[n] - lr * v[n]
    return p


def rand_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"body.0.weight": (3, 4), "body.0.bias": (3,), "head.weight": (2, 3), "head.bias": (2,)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


def far(a: dict, b: dict, names=NAMES, gap: float = 1e-3) -> bool:
    """The two parameter sets differ by more than ``gap`` somewhere (the swapped role is detectable)."""
    return max(float((a[n] - b[n]).abs().max()) for n in names) > gap


@pytest.fixture
def client():
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(3, 2)).double()
    assert [n for n, _ in net.named_parameters()] == NAMES
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])

    def ctx(momentum: float = MOMENTUM) -> ClientContext:
        opt = ClientOptimizer(lr=LR, momentum=momentum, weight_decay=0.0, batch_size=100)  # full batch
        return client_context(
            net, x, y, optimizer=opt, loss=F.cross_entropy, generator=torch.Generator().manual_seed(2),
        )

    return ctx, x, y


# a digits federation where client sizes differ a lot and client 1 has no test data (Dirichlet α = 0.05)
RUN_DATA = {
    "class_path": "datamodules.DigitsDataModule",
    "init_args": {
        "num_clients": 20, "participation": 0.2, "seed": 0,
        "partition": {"class_path": "datamodules.Dirichlet", "init_args": {"alpha": 0.05, "min_samples": 5}},
    },
}  # fmt: skip


ROUNDS, EVAL_EVERY, EVAL_LAST = 10, 3, 4


def read_metrics(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def fedper_run(tmp_path_factory):
    """One tiny train.py run (FedPer, a 16-unit MLP): its run folder."""
    from fl_lightning.cli import train_config

    tmp = tmp_path_factory.mktemp("fedper_run")
    data = tmp / "data.yaml"
    data.write_text(yaml.safe_dump({"data": RUN_DATA}))
    run_dir = tmp / "run"
    overrides = [
        "--model.network.init_args.hidden", "[16]", "--model.lr", "0.05", "--trainer.max_steps", str(ROUNDS),
        "--model.eval_every", str(EVAL_EVERY), "--model.eval_last", str(EVAL_LAST), "--checkpoint_every", str(ROUNDS),
    ]  # fmt: skip
    configs = [ROOT / "configs" / "digits" / "base.yaml", ROOT / "configs" / "digits" / "fedper.yaml", data]
    train_config(configs, overrides, run_dir=run_dir)
    return run_dir
