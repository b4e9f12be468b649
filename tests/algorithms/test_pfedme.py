"""pFedMe (Dinh et al. 2020; ``fl_lightning/algorithms/pfedme.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fl_lightning.algorithms import PFedMe
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext, loss_fn_for, state_template
from fl_lightning.engine.state import state_name
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.round_references import (
    LR,
    MOMENTUM,
    Run,
    assert_matches,
    max_difference,
    mean_of,
    model_with,
    params_of,
)


# ---- pFedMe ------------------------------------------------------------------------------------------------------
def pfedme_client(template, w0, x, y, lam, personal_lr, inner, local, swap=False):
    """Algorithm 1: R times (K GD steps of f(θ) + λ/2‖θ − w‖² at the personal lr; SGD step on w with gradient
    λ(w − θ)). Returns (local model w, personal model θ); ``swap`` returns them the other way round."""
    local_model, personal = model_with(template, w0), model_with(template, w0)
    opt = torch.optim.SGD(local_model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(local):
        for _ in range(inner):
            prox = sum(((p - q.detach()) ** 2).sum() for p, q in zip(personal.parameters(), local_model.parameters()))
            loss = F.cross_entropy(personal(x), y) + lam / 2 * prox
            grads = torch.autograd.grad(loss, list(personal.parameters()))
            with torch.no_grad():
                for p, g in zip(personal.parameters(), grads):
                    p -= personal_lr * g
        opt.zero_grad()
        for p, q in zip(local_model.parameters(), personal.parameters()):
            p.grad = lam * (p.detach() - q.detach())
        opt.step()
    w, theta = params_of(local_model), params_of(personal)
    return (theta, w) if swap else (w, theta)


def pfedme_reference(run, lam, personal_lr, inner, local, beta, swap=False):
    w, theta = dict(run.init), {c: dict(run.init) for c in range(4)}
    for cohort in run.cohorts:
        uploads = []
        for c in cohort:
            w_c, theta[c] = pfedme_client(run.template, w, *run.data[c], lam, personal_lr, inner, local, swap)
            uploads.append(w_c)
        mean = mean_of(uploads)
        w = {n: (1 - beta) * w[n] + beta * mean[n] for n in w}  # β-mixing
    return w, theta


def test_pfedme_client_and_server_updates_match_the_reference_over_rounds():
    lam, personal_lr, inner, local, beta = 15.0, 0.02, 3, 4, 0.7
    run = Run(PFedMe(lam=lam, personal_lr=personal_lr, inner_steps=inner, local_steps=local), server_lr=beta)
    w, theta = pfedme_reference(run, lam, personal_lr, inner, local, beta)
    assert max_difference(w, run.init) > 1e-3
    assert_matches(run.global_params(), w, w)
    for c in range(4):  # θ_i of every client (the unsampled ones keep theirs), evaluated with
        assert_matches(run.bank("theta.", c), theta[c], w)
    swapped, _ = pfedme_reference(run, lam, personal_lr, inner, local, beta, swap=True)  # uploading θ, keeping w
    assert max_difference(run.global_params(), swapped) > 1e-3


D, N, BS, LR_2, MOM, SCALE = 3, 5, 2, 0.1, 0.5, 2.0


LAM, PLR, K = 1.5, 0.05, 2


class Tiny(nn.Module):
    """y = s·⟨θ, x⟩ with a fixed buffer s (a non-trained entry of the parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 1, bias=False)
        self.register_buffer("scale", torch.tensor(SCALE, dtype=torch.float64))

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(x).squeeze(-1) * self.scale


def data(n: int = N) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    glob = {"fc.weight": torch.randn(1, D, generator=g, dtype=torch.float64), "scale": torch.tensor(SCALE).double()}
    return x, y, glob


def context(x: torch.Tensor, y: torch.Tensor, budget: float = 1.0) -> ClientContext:
    opt = ClientOptimizer(lr=LR_2, momentum=MOM, batch_size=BS)
    return client_context(
        Tiny().double(), x, y, optimizer=opt, loss=loss_fn_for(None), generator=make_generator(0, "pfedme"),
        step_budget=budget,
    )


def np_pfedme(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, rounds: int, buf: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Returns (w, θ̃, mean loss, momentum buffer) after ``rounds`` local rounds."""
    theta, g, batches, loss_sum = w.copy(), make_generator(0, "pfedme"), [], 0.0
    for _ in range(rounds):
        if not batches:
            perm = torch.randperm(len(y), generator=g).numpy()
            batches = [perm[i : i + BS] for i in range(0, len(y), BS)]
        idx = batches.pop(0)
        xb, yb, anchor, inner = x[idx], y[idx], w.copy(), []
        for _ in range(K):
            r = SCALE * xb @ theta - yb
            inner.append(0.5 * np.mean(r**2))
            theta = theta - PLR * (SCALE * xb.T @ r / len(yb) + LAM * (theta - anchor))
        grad = LAM * (anchor - theta)
        buf = grad if buf is None else MOM * buf + grad
        w = anchor - LR_2 * buf
        loss_sum += np.mean(inner)
    return w, theta, loss_sum / max(rounds, 1), buf


@pytest.mark.parametrize(("budget", "rounds"), [(1.0, 4), (0.25, 1)])
def test_client_update_against_numpy(budget, rounds):
    """R = 4 rounds cross an epoch (3 minibatches of 5 samples at B = 2); a straggler at ¼ runs ⌊¼·4⌋ = 1."""
    x, y, glob = data()
    algo = PFedMe(lam=LAM, personal_lr=PLR, inner_steps=K, local_steps=4)
    up = algo.client_update(context(x, y, budget), glob, algo.init_client_state(glob))
    w, theta, loss, _ = np_pfedme(x.numpy(), y.numpy(), glob["fc.weight"].numpy()[0], rounds, None)
    assert_close_finite(up.upload["fc.weight"][0], w, rtol=1e-10, atol=1e-12)
    assert_close_finite(up.state["theta.fc.weight"][0], theta, rtol=1e-10, atol=1e-12)
    assert float(up.state["theta.scale"]) == SCALE  # not trained: the personal model keeps w's value
    assert sorted(up.state) == ["theta.fc.weight", "theta.scale"]
    assert up.loss == pytest.approx(loss, rel=1e-10) and up.loss > 0
    assert up.num_samples == N


def test_kept_momentum_continues_and_is_saved():
    """With a kept optimiser state (3 earlier steps, a momentum buffer) the first step continues that buffer; the
    saved state counts 3 + R steps and holds the last buffer."""
    x, y, glob = data()
    algo = PFedMe(lam=LAM, personal_lr=PLR, inner_steps=K, local_steps=2)
    ctx = context(x, y)
    kept = state_template(ctx.optimizer, {"fc.weight": glob["fc.weight"]})
    buf0 = torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64)
    kept[state_name("steps", "fc.weight")] = torch.tensor(3)
    kept[state_name("momentum_buffer", "fc.weight")] = buf0.clone()
    ctx.optimizer_state = kept
    up = algo.client_update(ctx, glob, algo.init_client_state(glob))
    w, _, _, buf = np_pfedme(x.numpy(), y.numpy(), glob["fc.weight"].numpy()[0], 2, buf0.numpy()[0])
    assert_close_finite(up.upload["fc.weight"][0], w, rtol=1e-10, atol=1e-12)
    assert int(ctx.optimizer_state[state_name("steps", "fc.weight")]) == 5
    assert_close_finite(ctx.optimizer_state[state_name("momentum_buffer", "fc.weight")][0], buf, rtol=1e-10, atol=1e-12)


def test_rounds_for_full_straggler_and_empty_clients():
    algo = PFedMe(local_steps=4)
    x, y, _ = data()

    def rounds(ctx: ClientContext) -> int:
        return algo.rounds_for(ctx.num_samples, ctx.step_budget)

    assert rounds(context(x, y, 1.0)) == 4
    assert rounds(context(x, y, 1.5)) == 4  # a budget ≥ 1 is a full client (as ``step_limit``)
    assert rounds(context(x, y, 0.5)) == 2  # ⌊0.5·4⌋
    assert rounds(context(x, y, 0.05)) == 1  # at least one
    assert rounds(context(x[:1], y[:1])) == 4
    assert rounds(context(x[:0], y[:0])) == 0


def test_client_model_is_the_personal_model():
    algo = PFedMe()
    glob = {"fc.weight": torch.zeros(1, D), "scale": torch.tensor(1.0)}
    theta = torch.ones(1, D)
    model = algo.client_model(glob, {"theta.fc.weight": theta})
    assert model["fc.weight"] is theta and model["scale"] is glob["scale"]


def test_argument_checks_boundaries_and_defaults():
    PFedMe(lam=0.5, personal_lr=1e-9, inner_steps=1, local_steps=1)
    for kwargs in ({"lam": 0.0}, {"personal_lr": 0.0}, {"inner_steps": 0}, {"local_steps": 0}):
        with pytest.raises(ConfigError):
            PFedMe(**kwargs)
    algo = PFedMe()
    assert (algo.lam, algo.personal_lr, algo.inner_steps, algo.local_steps) == (15.0, 0.09, 5, 20)
