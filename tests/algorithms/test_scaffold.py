"""SCAFFOLD (Karimireddy et al. 2020, option II; ``fl_lightning/algorithms/scaffold.py``) against references written
here: its arguments and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import torch

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import SCAFFOLD
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.functional_mlp import LR, NAMES, HeavyBall, close, rand_params, ref_grad
from tests.helpers.training import make_trainer


# ---- SCAFFOLD -----------------------------------------------------------------------------------------------
def scaffold_with(glob, c, num_clients=5, epochs=3):
    alg = SCAFFOLD(local_epochs=epochs)
    alg.setup(glob, num_clients=num_clients)
    for n in NAMES:
        getattr(alg, "c__" + n.replace(".", "__")).copy_(c[n])
    return alg


def scaffold_reference(glob, c, c_i, x, y, steps):
    """K momentum steps on g − c_i + c from x; c_i⁺ = c_i − c + (x − y)/(Kη) (option II)."""
    y_, opt = dict(glob), HeavyBall()
    for _ in range(steps):
        g = ref_grad(y_, x, y)
        y_ = opt.step(y_, {n: g[n] - c_i[n] + c[n] for n in NAMES})
    return y_, {n: c_i[n] - c[n] + (glob[n] - y_[n]) / (steps * LR) for n in NAMES}


def test_scaffold_control_variate_update_option_ii(double_mlp_setup):
    ctx, x, y = double_mlp_setup
    glob = rand_params(4)
    c, c_i = ({n: 0.1 * t for n, t in rand_params(s).items()} for s in (5, 6))
    alg = scaffold_with(glob, c)
    state = {"c_i." + n: c_i[n] for n in NAMES}
    upd = alg.client_update(ctx(), glob, state)

    y_, c_new = scaffold_reference(glob, c, c_i, x, y, steps=3)
    close({n: upd.upload[n] for n in NAMES}, y_)
    close({n: upd.state["c_i." + n] for n in NAMES}, c_new)
    close({n: upd.upload["delta_c." + n] for n in NAMES}, {n: c_new[n] - c_i[n] for n in NAMES})
    # the correction's sign matters: with c and c_i swapped the model moves elsewhere
    swapped, _ = scaffold_reference(glob, c_i, c, x, y, steps=3)
    assert max(float((swapped[n] - upd.upload[n]).abs().max()) for n in NAMES) > 1e-3

    # server: c ← c + (|S|/N)·mean Δc_i, |S| = the number of uploads the engine aggregated
    avg = {"delta_c." + n: torch.full_like(glob[n], 2.0) for n in NAMES}
    alg.server_update(dict(glob), avg, RoundFacts(0, num_aggregated=2))
    for n in NAMES:
        assert_close_finite(alg.server_variate()[n], c[n] + 2 / 5 * 2.0)


def test_scaffold_k_counts_a_stragglers_capped_steps(double_mlp_setup):
    """A straggler with budget ½ of 4 full-batch epochs takes 2 steps: K = 2 in c_i⁺, not 4."""
    ctx, x, y = double_mlp_setup
    glob = rand_params(4)
    c, c_i = ({n: 0.1 * t for n, t in rand_params(s).items()} for s in (5, 6))
    upd = scaffold_with(glob, c, epochs=4).client_update(ctx(budget=0.5), glob, {"c_i." + n: c_i[n] for n in NAMES})
    y_, c_new = scaffold_reference(glob, c, c_i, x, y, steps=2)
    close({n: upd.upload[n] for n in NAMES}, y_)
    close({n: upd.state["c_i." + n] for n in NAMES}, c_new)


def test_scaffold_server_variate_survives_checkpoint_resume(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(SCAFFOLD(), DigitsMLP(hidden=(16,)), eval_every=100, eval_last=1, aggregation="uniform")

    def data():
        return DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)

    full = module()
    make_trainer(4).fit(full, datamodule=data())
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    make_trainer(4, enable_checkpointing=True, callbacks=[ckpt]).fit(module(), datamodule=data())
    resumed = module()
    make_trainer(4).fit(resumed, datamodule=data(), ckpt_path=str(tmp_path / "r2.ckpt"))
    for n, c in full.algorithm.server_variate().items():
        assert c.abs().sum() > 0 and torch.equal(resumed.algorithm.server_variate()[n], c), n
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n


def test_scaffold_before_setup_has_no_variates():
    algo = SCAFFOLD()
    assert algo.local_epochs == 1 and algo.num_clients == 0
    assert algo.server_variate() == {}
    assert algo.init_client_state({"w": torch.zeros(2)}) == {}


def test_scaffold_declares_its_drift_gradient_in_closed_form():
    """The drift term's closed-form gradient is autograd's gradient of ⟨y, c − c_i⟩ written here: c − c_i."""
    g = torch.Generator().manual_seed(0)
    y = {n: torch.randn(4, generator=g, dtype=torch.float64) for n in ("a", "b")}
    correction = {n: torch.randn(4, generator=g, dtype=torch.float64) for n in ("a", "b")}
    leaves = {n: v.clone().requires_grad_(True) for n, v in y.items()}
    value = sum((leaves[n] * correction[n]).sum() for n in leaves)
    expected = dict(zip(leaves, torch.autograd.grad(value, list(leaves.values()))))
    got = SCAFFOLD.drift_gradient(y, correction)
    assert set(got) == {"a", "b"} and all(torch.equal(got[n], expected[n]) for n in y)
    assert abs(float(SCAFFOLD.drift(y, correction)) - float(value)) < 1e-12
