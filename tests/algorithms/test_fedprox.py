"""FedProx (Li et al. 2020; ``fl_lightning/algorithms/fedprox.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import torch

from fl_lightning.algorithms import FedProx
from tests.helpers.functional_mlp import NAMES, HeavyBall, close, rand_params, ref_grad


# ---- FedProx ------------------------------------------------------------------------------------------------
def test_fedprox_gradient_is_loss_gradient_plus_mu_times_distance(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    glob, mu = rand_params(3), 0.7
    upd = FedProx(mu=mu, local_epochs=4).client_update(ctx(), glob, {})
    w, opt = dict(glob), HeavyBall()
    for _ in range(4):  # ∇(f + μ/2‖w − w_g‖²) = ∇f + μ(w − w_g), with momentum 0.5
        g = ref_grad(w, x, y)
        w = opt.step(w, {n: g[n] + mu * (w[n] - glob[n]) for n in NAMES})
    close(upd.upload, w)
    # μ = 0 is FedAvg; the proximal term must make a difference after the first step
    plain = FedProx(mu=0.0, local_epochs=4).client_update(ctx(), glob, {})
    assert (plain.upload["head.weight"] - upd.upload["head.weight"]).abs().max() > 1e-4


def test_defaults_and_personal_prefixes():
    algo = FedProx()
    assert (algo.mu, algo.local_epochs, tuple(algo.personal)) == (0.1, 1, ())
    assert tuple(FedProx(personal=["head."]).personal) == ("head.",)


def test_fedprox_declares_its_proximal_gradient_in_closed_form():
    """The penalty's closed-form gradient (so no autograd pass through the term) is autograd's gradient of
    μ/2‖w − w^t‖² written here, at random points."""

    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(3, 2, generator=g, dtype=torch.float64) for n in ("a", "b")}
    anchor = {n: torch.randn(3, 2, generator=g, dtype=torch.float64) for n in ("a", "b")}
    leaves = {n: v.clone().requires_grad_(True) for n, v in w.items()}
    value = 0.5 * 0.7 * sum(((leaves[n] - anchor[n]) ** 2).sum() for n in leaves)
    expected = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    algo = FedProx(mu=0.7)
    assert set(algo.proximal_gradient(w, anchor)) == {"a", "b"}
    for n in w:
        assert torch.allclose(algo.proximal_gradient(w, anchor)[n], expected[n], rtol=0, atol=1e-14)
    assert abs(float(algo.proximal(w, anchor)) - float(value)) < 1e-12
