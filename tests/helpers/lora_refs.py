"""Plain-torch references for the adapter methods' client updates: full-batch SGD on a copy of the network over
the chosen parameters (so the batch order cannot matter), and the client context the methods get."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from tests.helpers.clients import client_context

LR, MOMENTUM = 0.1, 0.5


def context(net: nn.Module, x, y, client: int = 3, round_idx: int = 0, seed: int = 0):
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, batch_size=10_000)
    gen = make_generator(seed, "t", round_idx, client)
    return client_context(
        net, x, y, client=client, optimizer=opt, loss=F.cross_entropy, generator=gen, round_idx=round_idx, seed=seed
    )


def params_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def loaded(net: nn.Module, values: dict[str, torch.Tensor]) -> nn.Module:
    net = copy.deepcopy(net)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n in values:
                p.copy_(values[n])
    return net


def reference_sgd(net: nn.Module, start: dict, x, y, trains: Callable[[str], bool], epochs: int,
                  forward: Callable | None = None, lr: float = LR) -> dict[str, torch.Tensor]:  # fmt: skip
    """``epochs`` full-batch momentum-SGD steps (torch.optim.SGD) on the parameters ``trains`` picks."""
    net = loaded(net, start)
    chosen = [p for n, p in net.named_parameters() if trains(n)]
    opt = torch.optim.SGD(chosen, lr=lr, momentum=MOMENTUM)
    for _ in range(epochs):
        opt.zero_grad()
        out = net(x) if forward is None else forward(net, x)
        F.cross_entropy(out, y).backward()
        opt.step()
    return params_of(net)


def assert_close(actual: dict, expected: dict, names, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for n in names:
        torch.testing.assert_close(actual[n], expected[n], rtol=rtol, atol=atol, msg=n)


def prepared(algorithm, net: nn.Module):
    """As the engine prepares an algorithm (``FederatedModule.attach_data``): its network check, then the frozen
    base named (``Algorithm.set_frozen``)."""
    algorithm.check_compatible(net, 2)
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    algorithm.set_frozen(frozen + list(net.constant_buffers))
    return algorithm
