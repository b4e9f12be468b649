"""The digits MLP on random 8×8 inputs for the client-update references: the data, a ``ClientContext``, parameter
dicts, reference SGD in plain torch and the ``digits_mlp_setup`` fixture (network, data, global and personal head)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

LR, MOMENTUM = 0.05, 0.5


def client_data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def context(net, x, y, loss=F.cross_entropy):
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, batch_size=10_000)
    return client_context(net, x, y, client=3, optimizer=opt, loss=loss, generator=make_generator(0, "t", 0, 3))


def params_of(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def reference_sgd(net, x, y, trainable_prefixes, epochs):
    """Plain torch: a model copy, an SGD optimiser over the chosen parameters, ``epochs`` full-batch steps."""
    net = copy.deepcopy(net)
    chosen = [p for n, p in net.named_parameters() if n.startswith(tuple(trainable_prefixes))]
    opt = torch.optim.SGD(chosen, lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return params_of(net)


def assert_params_close(actual, expected, names):
    for n in names:
        assert_close_finite(actual[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def with_state(net, state):
    net = copy.deepcopy(net)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n in state:
                p.copy_(state[n])
    return net


@pytest.fixture
def digits_mlp_setup():
    torch.manual_seed(0)
    net = DigitsMLP()
    x, y = client_data()
    glob = params_of(net)
    personal_head = {n: v + 0.1 * torch.randn_like(v) for n, v in glob.items() if n.startswith("head.")}
    return net, x, y, glob, personal_head
