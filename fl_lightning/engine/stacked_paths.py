"""The stacked path's sub-paths: how a run's phases compute on it, decided once per run.

``executor.decide`` asks ``plan_stacked``, records the answer in its ``Decision`` (beside how the run evaluates,
``executor.evaluation_path``) and says it in the run's one executor line; ``VectorizedContext`` reads the plan it is
given (a context built without one, as the tests and the benchmark build it, plans itself once, from its own
network, optimiser and data, with the same function). What ``plan_stacked`` decides from the run:

* ``in turn``: every client in turn with the sequential ``ClientContext`` (on the same generators: the loop's
  numbers), because the client optimiser has no batched form or the augmentation cannot draw ahead; recurrent
  networks (LSTM: no batching rule for per-client weights) run their whole-network phases so;
* ``conv in turn``: convolutional networks on a device whose ``CONV_CLIENTS`` is ``loop`` (the CPU: plain autograd
  in ``channels_last`` beat both ``vmap`` and grouped convolutions there, ``make bench`` measures it);
* ``fused relu mlp``: ``Linear``/``ReLU``/``Flatten`` networks with the cross-entropy, stepped with batched matrix
  products and the gradient written by hand (``relu_net_gradient``);
* ``batched matmul``: other networks of ``Linear`` layers and elementwise activations (``stacked_forward`` and
  ordinary autograd, without ``vmap``);
* ``vmap``: other networks (``torch.func.vmap`` over clients), and any network with side data;
* ``head``: how a phase that trains only the head of a frozen body computes (the head's own form, on the body's
  features computed ahead in a few no-grad passes), or None where the features are not cached (BatchNorm, side
  branches, no body/head split).

What stays with the phase (the algorithm's arguments, not the run's): a phase with its own step direction or
objective is vmapped on the batched sub-paths (and runs with ``ClientContext`` on ``conv in turn``, as does one with
side data or kept optimiser state), and a penalty without a closed-form gradient takes autograd instead of the
hand-written ReLU gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fl_lightning.client import ClientOptimizer, factory_name
from fl_lightning.engine.batched_optim import batched_rule
from fl_lightning.engine.sequential import draws_ahead, has_batchnorm
from fl_lightning.engine.stacked_nets import has_conv, has_rnn, relu_layers, stackable

SgdPath = Literal["in turn", "conv in turn", "fused relu mlp", "batched matmul", "vmap"]

#: How convolutional phases run over per-client weights, by device type: ``loop`` (client by client, plain autograd
#: in channels_last) or ``vmap`` (one grouped convolution for the cohort). ``loop`` won on the CPU (``make bench``,
#: workload ``conv_clients``); other devices use ``vmap`` unless set here (the benchmark reports both).
CONV_CLIENTS: dict[str, str] = {"cpu": "loop"}


def conv_clients(device: torch.device) -> str:
    return CONV_CLIENTS.get(device.type, "vmap")


def conv_in_turn(net: nn.Module, device: torch.device) -> bool:
    """Whether ``net``'s convolutional phases run client by client on ``device`` (``CONV_CLIENTS``)."""
    return has_conv(net) and conv_clients(device) == "loop"


@dataclass(frozen=True)
class StackedPaths:
    """How the stacked path trains a run's phases (see the module docstring); ``why``: the reason clients run
    ``in turn``."""

    sgd: SgdPath
    head: SgdPath | None = None
    why: str | None = None

    def describe(self) -> str:
        """E.g. ``fused relu mlp, heads on cached features``, ``conv in turn, heads fused relu mlp on cached
        features``, ``in turn: client optimizer RMSprop has no batched form``."""
        text = self.sgd if self.why is None else f"{self.sgd}: {self.why}"
        if self.head is None:
            return text
        return f"{text}, heads {'' if self.head == self.sgd else self.head + ' '}on cached features"


def step_form(module: nn.Module, classification: bool, sides: bool) -> SgdPath:
    """How a batched phase steps ``module`` (the network, or the head on cached features)."""
    if sides or not stackable(module):
        return "vmap"
    return "fused relu mlp" if classification and relu_layers(module) is not None else "batched matmul"


def caches_features(net: nn.Module, sides: bool, cache_features: bool = True) -> bool:
    """Whether head-only phases train on the frozen body's features computed ahead (not through BatchNorm layers,
    whose train-mode features depend on the batch, nor with side data)."""
    return (
        cache_features
        and not sides
        and not has_batchnorm(net)
        and getattr(net, "side", None) is None
        and isinstance(getattr(net, "body", None), nn.Module)
        and isinstance(getattr(net, "head", None), nn.Module)
    )


def plan_stacked(
    net: nn.Module,
    device: torch.device,
    optimizer: ClientOptimizer,
    augment: Any,
    classification: bool,
    sides: bool,
    cache_features: bool = True,
    loop_over_clients: bool | None = None,
) -> StackedPaths:
    """The run's ``StackedPaths`` (``loop_over_clients``: ``conv in turn`` forced on or off, default
    ``CONV_CLIENTS``)."""
    if batched_rule(optimizer) is None:
        return StackedPaths("in turn", why=f"client optimizer {factory_name(optimizer.factory)} has no batched form")
    if augment is not None and not draws_ahead(augment):
        return StackedPaths("in turn", why="the augmentation cannot draw ahead")
    head = step_form(net.head, classification, sides) if caches_features(net, sides, cache_features) else None
    if has_rnn(net):
        return StackedPaths("in turn", head, why="recurrent layers (LSTM) have no batched form")
    if loop_over_clients is None:
        loop_over_clients = conv_in_turn(net, device)
    if loop_over_clients:
        return StackedPaths("conv in turn", head)
    return StackedPaths(step_form(net, classification, sides), head)
