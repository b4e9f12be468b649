"""Per-FedAvg (Fallah et al. 2020) against numpy references written here: the documented defaults and the
support/target checks with their edges, the meta-step's losses seeing the batch mask (the vectorized executor's
padded rows count for nothing), and one client update of first-order meta-steps over a replayed shuffle (batches of
support + target; a last batch without a target sample skipped; the reported loss f(w̃; D'))."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import LinearRegressor, assert_close_finite
from torch import Tensor

from fl_lightning.algorithms import PerFedAvg
from fl_lightning.client import ClientContext, ClientOptimizer, loss_fn_for
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError

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
    ctx = ClientContext(
        LinearRegressor(D, bias=False).double(), 0, x, y, None, opt, loss_fn_for(None), make_generator(2, "pfa")
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
