"""New-client transfer of a trained network (spec 004 §4.2): fine-tune on each new client, then top-1 accuracy.

Each new client (``datamodule.new_clients``, e.g. CIFAR-100 classes 80–99) starts from the trained parameters with a
freshly initialised head (the new classes share no output with the training classes; spec 004 leaves the head
handling open), optionally keeps only ``finetune_samples`` class-balanced training samples (2–3 per class for 50
samples over 20 classes), runs ``epochs`` epochs of local SGD on ``prefixes`` (``""`` = the whole model) through the
engine's ``ClientContext.sgd``, and is scored on its own test split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for


def balanced_subset(y: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` indices with the classes of ``y`` as equal as possible (round-robin over shuffled classes)."""
    classes = y.unique()
    pools = [torch.nonzero(y == c).flatten() for c in classes[torch.randperm(len(classes), generator=generator)]]
    pools = [p[torch.randperm(len(p), generator=generator)] for p in pools]
    picked, depth = [], 0
    while len(picked) < min(count, len(y)):
        for p in pools:
            if depth < len(p) and len(picked) < count:
                picked.append(p[depth])
        depth += 1
    return torch.stack(picked)


def evaluate_new_clients(
    net: nn.Module,
    new_clients: FederatedData,
    epochs: int = 10,
    lr: float = 0.1,
    momentum: float = 0.5,
    weight_decay: float = 1e-4,
    batch_size: int = 10,
    prefixes: Sequence[str] = ("",),
    finetune_samples: int | None = None,
    reinit_head: bool = True,
    seed: int = 0,
) -> Tensor:
    """Top-1 test accuracy of every new client after fine-tuning: ``[num_new_clients]``."""
    base = {n: p.detach().clone() for n, p in net.named_parameters()}
    base.update({n: b.detach().clone() for n, b in net.named_buffers()})
    optimizer = ClientOptimizer(lr, momentum, weight_decay, batch_size)
    accs = []
    for c in range(new_clients.num_clients):
        gen = make_generator(seed, "new-client", c)
        params = dict(base)
        if reinit_head:
            for name in [n for n in params if n.startswith("head.")]:
                fresh = torch.empty_like(params[name])
                bound = params[name].shape[-1] ** -0.5 if params[name].dim() > 1 else 0.0
                params[name] = fresh.uniform_(-bound, bound, generator=gen) if bound else fresh.zero_()
        x, y = new_clients.train.client(c)
        if finetune_samples is not None:
            idx = balanced_subset(y, finetune_samples, gen)
            x, y = x[idx], y[idx]
        side = None if new_clients.side is None else new_clients.side[c]
        ctx = ClientContext(
            net, c, x, y, side, optimizer, loss_fn_for(new_clients.num_classes), gen, new_clients.augment, 0, seed
        )
        was_training = net.training
        net.train()
        params = ctx.sgd(params, ctx.params_with(prefixes), epochs)
        net.eval()
        xt, yt = new_clients.test.client(c)
        with torch.no_grad():
            pred = ClientContext(net, c, xt, yt, side, optimizer, ctx.loss_fn, gen).forward(params, xt).argmax(-1)
        net.train(was_training)
        accs.append((pred == yt).float().mean() if len(yt) else torch.tensor(float("nan")))
    return torch.stack(accs)
