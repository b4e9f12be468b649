"""APFL (Deng et al. 2020; ``fl_lightning/algorithms/apfl.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from fl_lightning.algorithms import APFL
from fl_lightning.algorithms.apfl import mix
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import loss_fn_for
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.functional_mlp import NAMES, HeavyBall, close, rand_params, ref_grad
from tests.helpers.models import LinearRegressor


# ---- APFL ---------------------------------------------------------------------------------------------------
def apfl_reference(glob, v0, a, x, y, steps, wd=0.0, decay_bias=True):
    """Per step, both at the pre-step (w, v): w ← SGD(∇f(w)), v ← SGD(α∇f(αv + (1−α)w)) (chain rule)."""
    w, v = dict(glob), dict(v0)
    opt_w, opt_v = HeavyBall(wd=wd, decay_bias=decay_bias), HeavyBall(wd=wd, decay_bias=decay_bias)
    for _ in range(steps):
        mixed = {n: a * v[n] + (1 - a) * w[n] for n in NAMES}
        gw, gm = ref_grad(w, x, y), ref_grad(mixed, x, y)
        w, v = opt_w.step(w, gw), opt_v.step(v, {n: a * gm[n] for n in NAMES})
    return w, v


def test_apfl_mixed_model_and_steps(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    glob, v0, a = rand_params(9), rand_params(10), 0.3
    alg = APFL(alpha=a, local_epochs=3)
    state = {"v." + n: v0[n] for n in NAMES}
    close(alg.client_model(glob, state), {n: a * v0[n] + (1 - a) * glob[n] for n in NAMES})
    upd = alg.client_update(ctx(), glob, state)
    w, v = apfl_reference(glob, v0, a, x, y, steps=3)
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)


def test_apfl_honours_decay_bias_and_the_straggler_budget(double_mlp_setup):
    """Weight decay 0.1 on weights only (decay_bias=False), and a straggler with budget ½ of 4 epochs: 2 steps."""
    ctx, x, y = double_mlp_setup
    glob, v0, a = rand_params(9), rand_params(10), 0.3
    upd = APFL(alpha=a, local_epochs=4).client_update(
        ctx(budget=0.5, weight_decay=0.1, decay_bias=False), glob, {"v." + n: v0[n] for n in NAMES}
    )
    w, v = apfl_reference(glob, v0, a, x, y, steps=2, wd=0.1, decay_bias=False)
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)


D = 2


def test_defaults_and_alpha_edges() -> None:
    alg = APFL()
    assert alg.alpha == 0.25 and alg.local_epochs == 1
    assert APFL(alpha=0.0).alpha == 0.0 and APFL(alpha=1.0).alpha == 1.0
    for bad in (-1e-9, 1.0 + 1e-9, 1.5):
        with pytest.raises(ConfigError, match="alpha"):
            APFL(alpha=bad)


def test_mix_is_per_name_and_keeps_integer_buffers_and_missing_names() -> None:
    v = {"a": torch.tensor(2.0), "count": torch.tensor(4)}
    w = {"a": torch.tensor(4.0), "frozen": torch.tensor(1.0), "count": torch.tensor(8)}
    out = mix(0.25, v, w)
    assert set(out) == {"a", "frozen", "count"}
    assert_close_finite(out["a"], 0.25 * 2.0 + 0.75 * 4.0)
    assert_close_finite(out["frozen"], 1.0)
    assert out["count"].dtype == torch.int64 and int(out["count"]) == 8


class MaskedCtx:
    """A padded batch's loss as the vectorized executor computes it: the mean over the rows the mask keeps."""

    def batch_loss(self, params: dict[str, Tensor], x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        keep = torch.ones_like(y) if mask is None else mask
        r = x @ params["w"] - y
        return (0.5 * r**2 * keep).sum() / keep.sum()


def np_loss_grad(x: np.ndarray, y: np.ndarray, th: np.ndarray) -> tuple[float, np.ndarray]:
    r = x @ th - y
    return 0.5 * float(np.mean(r**2)), x.T @ r / len(y)


def test_gradients_see_the_mask() -> None:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, D, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)  # the last row is padding
    w, v = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([1.5, 0.25], dtype=torch.float64)
    alpha = 0.25
    step, loss = APFL(alpha=alpha).gradients(MaskedCtx(), ["w"])({"w": w, "v.w": v}, x, y, mask)  # type: ignore[arg-type]
    xk, yk = x[:2].numpy(), y[:2].numpy()
    _, g_w = np_loss_grad(xk, yk, w.numpy())
    f_mix, g_mix = np_loss_grad(xk, yk, alpha * v.numpy() + (1 - alpha) * w.numpy())
    assert_close_finite(step["w"], g_w)
    assert_close_finite(step["v.w"], alpha * g_mix)
    assert_close_finite(loss, f_mix)


def test_client_update_reports_the_mixed_models_loss() -> None:
    g = torch.Generator().manual_seed(12)
    x, y = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    w0, v0 = np.array([[0.3, -0.6]]), np.array([[1.0, 0.4]])
    alpha, lr = 0.4, 0.2
    opt = ClientOptimizer(lr=lr, momentum=0.9, batch_size=8)
    ctx = client_context(
        LinearRegressor(D, bias=False).double(), x, y, optimizer=opt, loss=loss_fn_for(None),
        generator=make_generator(0, "apfl"),
    )
    alg = APFL(alpha=alpha)
    up = alg.client_update(ctx, {"fc.weight": torch.tensor(w0)}, {"v.fc.weight": torch.tensor(v0)})

    xn, yn = x.numpy(), y.numpy()
    _, g_w = np_loss_grad(xn, yn, w0[0])
    f_mix, g_mix = np_loss_grad(xn, yn, alpha * v0[0] + (1 - alpha) * w0[0])
    assert_close_finite(float(up.loss), f_mix)
    assert_close_finite(up.upload["fc.weight"], w0 - lr * g_w[None, :])
    assert_close_finite(up.state["v.fc.weight"], v0 - lr * alpha * g_mix[None, :])


def test_init_client_state_and_client_model() -> None:
    glob = {"fc.weight": torch.tensor([[1.0, -2.0]]), "steps": torch.tensor(3)}
    alg = APFL(alpha=0.25)
    state = alg.init_client_state(glob)
    assert set(state) == {"v.fc.weight", "v.steps"} and state["v.fc.weight"] is glob["fc.weight"]
    mixed = alg.client_model(glob, {"v.fc.weight": torch.tensor([[5.0, 2.0]])})
    assert set(mixed) == {"fc.weight", "steps"}
    assert_close_finite(mixed["fc.weight"], np.array([[0.25 * 5.0 + 0.75 * 1.0, 0.25 * 2.0 - 0.75 * 2.0]]))
    assert int(mixed["steps"]) == 3
