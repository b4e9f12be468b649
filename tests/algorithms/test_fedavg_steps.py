"""FedAvgSteps (spec 004 §2.4) and L2GD's arguments (spec 000 §2.4): exactly τ local SGD steps against a numpy
replay of the client's shuffle, the straggler cap, the reported loss, the defaults and the p ∈ (0, 1) check."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from fl_lightning.algorithms import FedAvgSteps
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for
from fl_lightning.errors import ConfigError
from fl_lightning.models import LinearRepresentation
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.linear_tasks import engine_data
from tests.helpers.training import fit

D, K, N, BS, LR = 3, 2, 5, 2, 0.1


def problem() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    glob = {
        "body.weight": torch.randn(K, D, generator=g, dtype=torch.float64),
        "head.weight": torch.randn(1, K, generator=g, dtype=torch.float64),
    }
    return glob, torch.randn(N, D, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)


def context(x: torch.Tensor, y: torch.Tensor, budget: float = 1.0) -> ClientContext:
    net = LinearRepresentation(D, K).double()
    opt = ClientOptimizer(lr=LR, momentum=0.0, batch_size=BS)
    return client_context(
        net, x, y, optimizer=opt, loss=loss_fn_for(None), generator=make_generator(0, "fas", 0), step_budget=budget,
    )


def np_sgd(glob: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray, steps: int) -> tuple[np.ndarray, ...]:
    """Plain SGD on ½·mean((x Bᵀᵀ w − y)²) over the client's shuffled minibatches of BS (randperm per epoch from
    its generator), stopped after ``steps`` steps; returns (Bᵀ, w, mean minibatch loss)."""
    bt, w = glob["body.weight"].numpy().copy(), glob["head.weight"].numpy()[0].copy()
    g, done, losses = make_generator(0, "fas", 0), 0, []
    while done < steps:
        perm = torch.randperm(N, generator=g).numpy()
        for i in range(0, N, BS):
            if done == steps:
                break
            xb, yb = x[perm[i : i + BS]], y[perm[i : i + BS]]
            r = xb @ bt.T @ w - yb
            losses.append(0.5 * np.mean(r**2))
            gw, gbt = bt @ xb.T @ r / len(r), np.outer(w, xb.T @ r) / len(r)
            bt, w = bt - LR * gbt, w - LR * gw
            done += 1
    return bt, w, float(np.mean(losses))


@pytest.mark.parametrize(("budget", "steps"), [(1.0, 4), (0.5, 3)])
def test_fedavg_steps_takes_exactly_tau_steps_or_the_straggler_cap(budget, steps):
    """n = 5, B = 2: 3 steps per epoch, τ = 4 → 2 epochs started, stopped after 4 steps; a straggler at budget ½
    may take ⌊½ · 2 epochs · 3⌋ = 3."""
    glob, x, y = problem()
    ctx = context(x, y, budget)
    up = FedAvgSteps(local_steps=4).client_update(ctx, glob, {})
    bt, w, loss = np_sgd(glob, x.numpy(), y.numpy(), steps)
    assert int(ctx.steps_taken) == steps
    assert_close_finite(up.upload["body.weight"], bt, rtol=1e-10, atol=1e-12)
    assert_close_finite(up.upload["head.weight"], w[None], rtol=1e-10, atol=1e-12)
    assert float(up.loss) == pytest.approx(loss, rel=1e-10)


def test_fedavg_steps_default_is_one_epoch_of_500_samples_at_batch_10():
    assert FedAvgSteps().local_steps == 50
    FedAvgSteps(local_steps=1)
    with pytest.raises(ConfigError):
        FedAvgSteps(local_steps=0)


@pytest.mark.parametrize("tau", [1, 3])
def test_fedavg_steps_takes_exactly_tau_local_steps(tau):
    """One client, full-batch minibatches, no momentum: one round of FedAvgSteps = τ GD steps on ½·mse."""
    dm, fed, x, y = engine_data(1, 4, 2, 12)
    L.seed_everything(2)
    net = LinearRepresentation(4, 2)
    ref = [p.detach().clone().requires_grad_() for p in (net.body.weight, net.head.weight)]
    module = FederatedModule(FedAvgSteps(tau), net, lr=0.05, momentum=0.0, batch_size=12, eval_last=1)
    fit(module, dm, rounds=1, seed=2)
    xs, ys = fed.train.x.float(), fed.train.y.float()  # the engine casts the float64 data to the network dtype
    for _ in range(tau):
        loss = 0.5 * ((xs @ ref[0].T @ ref[1].T).squeeze(-1) - ys).square().mean()
        grads = torch.autograd.grad(loss, ref)
        ref = [(p - 0.05 * g).detach().requires_grad_() for p, g in zip(ref, grads)]
    assert_close_finite(net.body.weight.detach(), ref[0].detach(), rtol=1e-5, atol=1e-6)
    assert_close_finite(net.head.weight.detach(), ref[1].detach(), rtol=1e-5, atol=1e-6)
