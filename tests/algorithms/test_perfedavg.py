"""Per-FedAvg (Fallah et al. 2020; ``fl_lightning/algorithms/perfedavg.py``) against references written here: its
arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.nn import functional as F

from fl_lightning.algorithms import PerFedAvg
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import loss_fn_for
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.functional_mlp import LR, MOM, NAMES, HeavyBall, close, rand_params, ref_grad, ref_loss
from tests.helpers.linear_client import context, data, np_grad
from tests.helpers.models import LinearRegressor


# ---- Per-FedAvg ---------------------------------------------------------------------------------------------
def test_perfedavg_one_step_adaptation(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    w = rand_params(13)
    adapted = PerFedAvg(inner_lr=1e-4, adapt_lr=0.3).adapt_for_evaluation(ctx(), w)
    g = ref_grad(w, x, y)
    close(adapted, {n: w[n] - 0.3 * g[n] for n in NAMES})  # w − α∇f_i(w) on the client's training data
    default = PerFedAvg(inner_lr=1e-4).adapt_for_evaluation(ctx(), w)
    close(default, {n: w[n] - 1e-4 * g[n] for n in NAMES})


@pytest.mark.parametrize("first_order", [False, True])
def test_perfedavg_meta_gradient(double_mlp_setup, first_order):
    ctx, x, y = double_mlp_setup
    w, alpha = rand_params(14), 0.05
    support, target = (x[:4], y[:4]), (x[4:], y[4:])
    alg = PerFedAvg(inner_lr=alpha, first_order=first_order, hvp_delta=1e-5)
    got = alg.meta_gradient(ctx(), w, NAMES, support, target)

    g_in = ref_grad(w, *support)
    tilde = {n: w[n] - alpha * g_in[n] for n in NAMES}
    g_out = ref_grad(tilde, *target)
    if first_order:
        want = g_out
    else:  # exact Hessian-vector product of the support loss at w
        flat = torch.cat([w[n].reshape(-1) for n in NAMES])
        sizes = [w[n].numel() for n in NAMES]

        def f(z):
            parts = dict(zip(NAMES, (t.view_as(w[n]) for n, t in zip(NAMES, z.split(sizes)))))
            return ref_loss(parts, *support)

        vec = torch.cat([g_out[n].reshape(-1) for n in NAMES])
        hv = torch.autograd.functional.hvp(f, flat, vec)[1]
        hv = dict(zip(NAMES, (t.view_as(w[n]) for n, t in zip(NAMES, hv.split(sizes)))))
        want = {n: g_out[n] - alpha * hv[n] for n in NAMES}
    for n in NAMES:
        assert_close_finite(got[n], want[n], rtol=1e-6, atol=1e-8, msg=n)


def perfedavg_reference(w0, x, y, alpha, delta, epochs, seed, steps_cap=None, swap=False, wd=0.0):
    """Per-FedAvg (HF) written out: per epoch one shuffle of the client's samples cut into batches of 8 + 2; a
    batch with no target sample is skipped; D = its first 8 samples, D' = the rest (``swap``: the other way round);
    g = ∇f(w̃; D') − α[∇f(w + δg', D) − ∇f(w − δg', D)]/(2δ), w̃ = w − α∇f(w; D), g' = ∇f(w̃; D'); momentum step."""
    gen, w, opt, steps = torch.Generator().manual_seed(seed), dict(w0), HeavyBall(wd=wd, decay_bias=False), 0
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 10):
            idx = perm[i : i + 10]
            if len(idx) <= 8 or (steps_cap is not None and steps >= steps_cap):
                continue
            d, d2 = (idx[8:], idx[:8]) if swap else (idx[:8], idx[8:])
            g_in = ref_grad(w, x[d], y[d])
            g_out = ref_grad({n: w[n] - alpha * g_in[n] for n in NAMES}, x[d2], y[d2])
            plus = ref_grad({n: w[n] + delta * g_out[n] for n in NAMES}, x[d], y[d])
            minus = ref_grad({n: w[n] - delta * g_out[n] for n in NAMES}, x[d], y[d])
            w = opt.step(w, {n: g_out[n] - alpha * (plus[n] - minus[n]) / (2 * delta) for n in NAMES})
            steps += 1
    return w, steps


@pytest.mark.parametrize("n,budget", [(23, 1.0), (29, 1.0), (29, 0.5)])
def test_perfedavg_client_update_matches_a_plain_torch_meta_loop(double_mlp_setup, n, budget):
    """n = 23: batches 10, 10, 3 (the 3 are skipped); n = 29: 10, 10, 9 (8 support + 1 target). Momentum 0.5,
    weight decay 0.01 on weights only, 2 epochs; budget ½: a straggler stops after half of its 6 meta-steps."""
    ctx, _, _ = double_mlp_setup
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g)
    w0, alpha = rand_params(15), 0.05
    opt = ClientOptimizer(lr=LR, momentum=MOM, batch_size=100, weight_decay=0.01, decay_bias=False)
    net = ctx().net
    client = client_context(
        net, x, y, optimizer=opt, loss=F.cross_entropy, generator=torch.Generator().manual_seed(7), step_budget=budget,
    )
    upd = PerFedAvg(inner_lr=alpha, local_epochs=2).client_update(client, w0, {})
    full = 2 * (n // 10 + (n % 10 > 8))
    cap = None if budget == 1.0 else int(budget * full)
    want, steps = perfedavg_reference(w0, x, y, alpha, 1e-3, 2, seed=7, steps_cap=cap, wd=0.01)
    assert steps == (full if cap is None else cap) and upd.state == {}
    close(upd.upload, want)
    swapped, _ = perfedavg_reference(w0, x, y, alpha, 1e-3, 2, seed=7, steps_cap=cap, swap=True, wd=0.01)
    assert max(float((swapped[k] - upd.upload[k]).abs().max()) for k in NAMES) > 1e-4  # support/target matter


# -- Per-FedAvg --------------------------------------------------------------------------------------------------
def test_perfedavg_adapts_a_one_sample_client_and_keeps_an_empty_one() -> None:
    x, y, glob = data(1)
    alg = PerFedAvg(adapt_lr=0.2, adapt_steps=1)
    got = alg.adapt_for_evaluation(context(x, y), glob)
    w0, b0 = glob["fc.weight"].numpy(), glob["fc.bias"].numpy()
    _, dw, db = np_grad(x.numpy(), y.numpy(), w0, b0)
    assert_close_finite(got["fc.weight"], w0 - 0.2 * dw)
    assert_close_finite(got["fc.bias"], b0 - 0.2 * db)

    empty = alg.adapt_for_evaluation(context(x[:0], y[:0]), glob)
    assert_close_finite(empty["fc.weight"], w0)
    assert_close_finite(empty["fc.bias"], b0)


D = 2


def np_loss_grad(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    r = x @ w - y
    return 0.5 * float(np.mean(r**2)), x.T @ r / len(y)


def test_defaults() -> None:
    alg = PerFedAvg()
    assert alg.inner_lr == 1e-4 and alg.adapt_lr == 1e-4 and alg.local_epochs == 1
    assert alg.support == 8 and alg.target == 2 and alg.first_order is False
    assert alg.hvp_delta == 1e-3 and alg.adapt_steps == 1
    assert PerFedAvg(inner_lr=0.3).adapt_lr == 0.3 and PerFedAvg(inner_lr=0.3, adapt_lr=0.1).adapt_lr == 0.1


def test_support_and_target_must_each_be_at_least_one() -> None:
    ok = PerFedAvg(support=1, target=1)
    assert ok.support == 1 and ok.target == 1
    for kw in ({"support": 0}, {"target": 0}, {"support": 0, "target": 0}, {"support": -1, "target": 5}):
        with pytest.raises(ConfigError, match="support"):
            PerFedAvg(**kw)  # type: ignore[arg-type]


class MaskedCtx:
    """A padded batch's loss as the vectorized executor computes it: the mean over the rows the mask keeps."""

    def batch_loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        keep = torch.ones_like(y) if mask is None else mask
        r = x @ params["w"] - y
        return (0.5 * r**2 * keep).sum() / keep.sum()


def test_meta_step_losses_see_the_mask() -> None:
    g = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(3, D, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    xt, yt = torch.randn(2, D, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    ms = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)  # the last support row is padding
    mt = torch.tensor([1.0, 0.0], dtype=torch.float64)  # so is the last target row
    w = torch.tensor([0.4, -0.7], dtype=torch.float64)
    alpha = 0.5
    alg = PerFedAvg(inner_lr=alpha, first_order=True, support=3, target=2)
    step, loss = alg.meta_step(MaskedCtx(), {"w": w}, ["w"], (xs, ys, ms), (xt, yt, mt))  # type: ignore[arg-type]
    xs_, ys_, xt_, yt_ = xs[:2].numpy(), ys[:2].numpy(), xt[:1].numpy(), yt[:1].numpy()
    _, g_in = np_loss_grad(xs_, ys_, w.numpy())
    tilde = w.numpy() - alpha * g_in
    want_loss, want_g = np_loss_grad(xt_, yt_, tilde)
    assert_close_finite(step["w"], want_g)
    assert_close_finite(loss, want_loss)


def test_client_update_skips_a_last_batch_without_target_and_reports_the_meta_loss() -> None:
    """n = 6 with batches of 2 + 2: the first batch is a meta-step, the last one (2 samples: support only) is
    skipped; the first momentum-SGD step is −β·∇f(w̃; D')."""
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(6, D, generator=g, dtype=torch.float64), torch.randn(6, generator=g, dtype=torch.float64)
    w0 = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    alpha, beta = 0.4, 0.1
    opt = ClientOptimizer(lr=beta, momentum=0.9, batch_size=10)
    ctx = client_context(
        LinearRegressor(D, bias=False).double(), x, y, optimizer=opt, loss=loss_fn_for(None),
        generator=make_generator(2, "pfa"),
    )
    alg = PerFedAvg(inner_lr=alpha, first_order=True, support=2, target=2)
    up = alg.client_update(ctx, {"fc.weight": w0}, {})

    perm = torch.randperm(6, generator=make_generator(2, "pfa")).numpy()
    xb, yb = x.numpy()[perm[:4]], y.numpy()[perm[:4]]
    _, g_in = np_loss_grad(xb[:2], yb[:2], w0.numpy()[0])
    want_loss, g_out = np_loss_grad(xb[2:], yb[2:], w0.numpy()[0] - alpha * g_in)
    assert int(ctx.steps_taken) == 1
    assert_close_finite(up.upload["fc.weight"], (w0.numpy()[0] - beta * g_out)[None, :])
    assert_close_finite(float(up.loss), want_loss)
    assert up.state == {} and up.num_samples == 6


def test_perfedavg_is_tested_after_a_64_bit_fit() -> None:
    """The test stage casts the client data again inside Lightning's inference mode; PerFedAvg's adaptation step
    differentiates through them (it failed with "Inference tensors cannot be saved for backward", as on a GPU)."""
    import lightning as L

    from datamodules import DigitsDataModule, Shards
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import DigitsMLP
    from tests.helpers.training import make_trainer

    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(PerFedAvg(), DigitsMLP(hidden=(8,)))
    make_trainer(1, precision="64-true", limit_val_batches=0).fit(module, datamodule=dm)
    (tested,) = make_trainer(1, precision="64-true").test(module, datamodule=dm, verbose=False)
    assert next(module.net.parameters()).dtype == torch.float64
    assert {"test/acc_mean", "test/loss"} <= set(tested) and np.isfinite(tested["test/loss"])
