"""PowerInitLocalGD (spec 003) driven by hand, one client at a time, against numpy references written here:
argument checks and defaults, the weight-1 uploads of every phase, the client's loss, the dtype of S, the
download template and the κ buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fl_lightning.algorithms import PowerInitLocalGD
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.algorithms.lowrank_power import local_gd
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import LowRankFactors
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context

D, R, ROWS, MAX_ROWS = 6, 2, 5, 7


def block(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)


def setup_algo(algo: PowerInitLocalGD) -> tuple[LowRankFactors, dict[str, torch.Tensor]]:
    net = LowRankFactors(D, R, MAX_ROWS)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo.setup(glob, 1)
    return net, glob


def context(net: LowRankFactors, s: torch.Tensor, rnd: int) -> ClientContext:
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=100)
    return client_context(
        net, torch.arange(ROWS), s, optimizer=opt, loss=F.mse_loss, generator=make_generator(0, 0), round_idx=rnd,
    )


def test_argument_checks_boundaries():
    PowerInitLocalGD(alpha=0, sketches=1, local_steps=1)  # every lower bound accepted
    for kwargs in ({"alpha": -1}, {"sketches": 0}, {"local_steps": 0}):
        with pytest.raises(ConfigError):
            PowerInitLocalGD(**kwargs)


def test_defaults_one_communication_one_sketch_ten_plain_steps():
    algo = PowerInitLocalGD()
    assert (algo.alpha, algo.sketches, algo.local_steps, algo.nesterov) == (0, 1, 10, False)
    assert algo.communications == 1 and algo.kappa_rank is None


def test_download_template_is_v_only():
    v, u = torch.ones(D, R), torch.zeros(MAX_ROWS, R)
    out = PowerInitLocalGD().download_template({"V": v, "U": u})
    assert list(out) == ["V"] and out["V"] is v


def test_kappa_buffer_is_float64_even_for_float32_factors():
    algo = PowerInitLocalGD(sketches=3)
    algo.setup({"V": torch.zeros(D, R, dtype=torch.float32), "U": torch.zeros(MAX_ROWS, R)}, 2)
    assert algo.kappa.dtype == torch.float64 and tuple(algo.kappa.shape) == (3,)
    assert algo.candidates.dtype == torch.float32 and tuple(algo.candidates.shape) == (3, D, R)


def test_every_phase_uploads_with_weight_one_and_local_phase_reports_the_loss():
    """Round 0 (sketch), round 1..α (power step), round α+1 (local GD): weight 1 each; the GD round's loss is
    F = ½‖S − UVᵀ‖² after its last step (numpy reference of plain GD with γ = 1/σ_max²(V))."""
    algo = PowerInitLocalGD(alpha=1, sketches=1, local_steps=3)
    net, glob = setup_algo(algo)
    s = block()
    state = algo.init_client_state(glob)
    up0 = algo.client_update(context(net, s, 0), glob, state)
    assert up0.num_samples == 1
    algo.server_update(glob, up0.upload, RoundFacts(0, num_aggregated=1))
    up1 = algo.client_update(context(net, s, 1), glob, state)
    assert up1.num_samples == 1
    sn, cand = s.numpy(), algo.candidates[0].numpy()
    assert_close_finite(up1.upload["sketch"][0], sn.T @ (sn @ cand), rtol=1e-10, atol=1e-12)
    algo.server_update(glob, up1.upload, RoundFacts(1, num_aggregated=1))
    v = glob["V"].numpy()
    up2 = algo.client_update(context(net, s, 2), glob, state)
    assert up2.num_samples == 1
    u = torch.randn(ROWS, R, generator=make_generator(0, 0), dtype=torch.float64).numpy() / ROWS**0.5
    gamma = 1.0 / np.linalg.norm(v, 2) ** 2
    for _ in range(3):
        u = u - gamma * (u @ v.T - sn) @ v
    assert_close_finite(up2.state["U"][:ROWS], u, rtol=1e-9, atol=1e-12)
    assert up2.loss == pytest.approx(0.5 * np.sum((sn - u @ v.T) ** 2), rel=1e-10)
    assert up2.loss > 0


def test_float32_rows_are_cast_to_the_factors_dtype():
    """S in float32 with float64 factors: the round-0 sketch SᵀΦ is computed in float64."""
    algo = PowerInitLocalGD(sketches=2)
    net, glob = setup_algo(algo)
    s32 = block(torch.float32)
    up = algo.client_update(context(net, s32, 0), glob, algo.init_client_state(glob))
    phi = torch.randn(2, ROWS, R, generator=make_generator(0, 0), dtype=torch.float64).numpy()
    s = s32.double().numpy()
    assert up.upload["sketch"].dtype == torch.float64
    assert_close_finite(up.upload["sketch"], np.stack([s.T @ p for p in phi]), rtol=1e-12, atol=1e-12)


def np_local_gd(
    s: np.ndarray, v: np.ndarray, u: np.ndarray, y: np.ndarray, steps: int, start: int, nesterov: bool
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Spec 003 §2.3 written out: plain U ← U − γ(UVᵀ − S)V (Y = U), or Nesterov from Y with β_k = k/(k+3)."""
    gamma = 1.0 / np.linalg.norm(v, 2) ** 2
    losses = []
    for k in range(start, start + steps):
        if nesterov:
            new = y - gamma * (y @ v.T - s) @ v
            y = new + k / (k + 3) * (new - u)
        else:
            new = u - gamma * (u @ v.T - s) @ v
            y = new
        u = new
        losses.append(0.5 * float(np.sum((s - u @ v.T) ** 2)))
    return u, y, losses


def gd_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    s = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
    v = torch.randn(D, R, generator=g, dtype=torch.float64)
    u = torch.randn(ROWS, R, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, R, generator=g, dtype=torch.float64)  # a Y different from U
    return s, v, u, y


def test_local_gd_defaults_are_plain_gd_from_u_and_y_follows_u():
    """Without ``nesterov`` the step is taken from U (Y is ignored) and Y comes back equal to U."""
    s, v, u, y = gd_inputs()
    got_u, got_y, losses = local_gd(s, v, u, y, 4)
    ref_u, _, ref_losses = np_local_gd(s.numpy(), v.numpy(), u.numpy(), y.numpy(), 4, 0, False)
    assert_close_finite(got_u, ref_u, rtol=1e-10, atol=1e-12)
    assert_close_finite(got_y, ref_u, rtol=1e-10, atol=1e-12)
    assert_close_finite(losses, ref_losses, rtol=1e-10, atol=1e-12)


def test_local_gd_nesterov_counts_momentum_from_start():
    """β_k = k/(k+3) with k counted from ``start`` (0 by default: the first step has no momentum)."""
    s, v, u, _ = gd_inputs()
    got_u, got_y, _ = local_gd(s, v, u, u, 4, nesterov=True)
    ref_u, ref_y, _ = np_local_gd(s.numpy(), v.numpy(), u.numpy(), u.numpy(), 4, 0, True)
    assert_close_finite(got_u, ref_u, rtol=1e-10, atol=1e-12)
    assert_close_finite(got_y, ref_y, rtol=1e-10, atol=1e-12)
    got_u5, _, _ = local_gd(s, v, u, u, 4, 5, True)
    ref_u5, _, _ = np_local_gd(s.numpy(), v.numpy(), u.numpy(), u.numpy(), 4, 5, True)
    assert_close_finite(got_u5, ref_u5, rtol=1e-10, atol=1e-12)
    assert float(np.abs(ref_u5 - ref_u).max()) > 1e-6  # the start changes the momentum


def test_local_gd_records_every_record_th_step_and_the_last():
    """steps = 7 from start = 2 with record = 3: F after steps 3, 6 and 7 (counted from the call's first step)."""
    s, v, u, _ = gd_inputs()
    _, _, losses = local_gd(s, v, u, u, 7, 2, False, 3)
    _, _, ref = np_local_gd(s.numpy(), v.numpy(), u.numpy(), u.numpy(), 7, 2, False)
    assert len(losses) == 3
    assert_close_finite(losses, [ref[2], ref[5], ref[6]], rtol=1e-10, atol=1e-12)
    _, _, six = local_gd(s, v, u, u, 6, 2, False, 3)  # the last step is also a record step: listed once
    assert_close_finite(six, [ref[2], ref[5]], rtol=1e-10, atol=1e-12)
