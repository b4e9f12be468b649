"""References over several rounds for pFedMe, MOON, FedDyn and FedProto: a run of the engine (``Run``), the model
built from parameters, the nearest-prototype accuracy and the comparisons of a run with its reference."""

from __future__ import annotations

import copy
import math

import torch
from torch.nn import functional as F

from datamodules import DigitsDataModule, Dirichlet
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import fit

LR, MOMENTUM, ROUNDS = 0.05, 0.5, 3


FULL_BATCH = 10_000


# ---- the engine side: a short run that records its cohorts ---------------------------------------------------
def params_of(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def model_with(template, params):
    net = copy.deepcopy(template)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(params[n])
    return net


class Run:
    """An engine run of ``algorithm`` on 4 digits clients; ``cohorts`` lists the clients of every round."""

    def __init__(self, algorithm, aggregation="uniform", server_lr=1.0, rounds=ROUNDS, **module_kwargs):
        torch.manual_seed(0)
        net = DigitsMLP(hidden=(16, 8))
        self.template, self.init = copy.deepcopy(net), params_of(net)
        self.module = FederatedModule(
            algorithm, net, lr=LR, momentum=MOMENTUM, batch_size=FULL_BATCH, aggregation=aggregation,
            server_lr=server_lr, eval_every=100, eval_last=1, **module_kwargs,
        )  # fmt: skip
        self.cohorts: list[list[int]] = []
        original = self.module.run_clients

        def recording(clients, round_idx, glob, states, budgets):
            self.cohorts.append(list(clients))
            return original(clients, round_idx, glob, states, budgets)

        self.module.run_clients = recording
        dm = DigitsDataModule(num_clients=4, partition=Dirichlet(1.0, min_samples=30), clients_per_round=3, seed=0)
        fit(self.module, dm, rounds)
        self.data = [self.module.fed.train.client(c) for c in range(4)]
        assert len(self.cohorts) == rounds and any(set(a) & set(b) for a, b in zip(self.cohorts, self.cohorts[1:]))

    def global_params(self):
        return {n: p.detach() for n, p in self.module.net.named_parameters()}

    def bank(self, prefix, client):
        row = self.module.bank.get(client)
        return {n[len(prefix) :]: v for n, v in row.items() if n.startswith(prefix)}


def assert_matches(actual, expected, names, tol=2e-4):
    for n in names:
        assert_close_finite(actual[n], expected[n], rtol=tol, atol=tol * 0.1, msg=n)


def max_difference(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def mean_of(dicts, weights=None):
    weights = weights or [1.0] * len(dicts)
    return {n: sum(w * d[n] for w, d in zip(weights, dicts)) / sum(weights) for n in dicts[0]}


# ---- FedProto ----------------------------------------------------------------------------------------------------
def fedproto_train(model, x, y, prototypes, known, lam, epochs, seen=None):
    """CE + λ·mean_{b,k} (φ(x_b) − C̄^(y_b))²_k (nn.MSELoss; zero for samples whose class has no global prototype)
    by SGD, in place; each epoch's (full-batch) features φ(x) appended to ``seen``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        z = model.body(x)
        if seen is not None:
            seen.append(z.detach())
        distance = ((z - prototypes[y]) ** 2).mean(1) * known[y].float()
        loss = F.cross_entropy(model.head(z), y) + lam * distance.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def nearest_prototype_accuracy(model, x, y, prototypes, known):
    with torch.no_grad():
        d = torch.cdist(model.body(x), prototypes)
    d[:, ~known] = math.inf
    return float((d.argmin(1) == y).float().mean())


# ---- the digits configs, both executors -------------------------------------------------------------------------
DIGITS = ["configs/digits/base.yaml"]
