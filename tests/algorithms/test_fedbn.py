"""FedBN (Li et al. 2021; ``fl_lightning/algorithms/fedbn.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedBN
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.heavy_ball_mlp import (
    TOL,
    HeavyBall,
    TinyBN,
    assert_evaluation,
    far,
    fit,
    grads,
    leaves,
    scores,
    weighted_mean,
)
from tests.helpers.training import make_trainer

BN_PARAMS = ["body.bn.weight", "body.bn.bias"]


BN_STATS = ["body.bn.running_mean", "body.bn.running_var"]


SHARED = ["body.fc.weight", "body.fc.bias", "head.weight", "head.bias"]


def tiny_bn_forward(p: dict, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    """The forward pass by hand; in training mode also the new running statistics (momentum 0.1, unbiased var)."""
    h = x.flatten(1) @ p["body.fc.weight"].T + p["body.fc.bias"]
    stats = {}
    if train:
        mean, var = h.mean(0), h.var(0, unbiased=False)
        stats["body.bn.running_mean"] = 0.9 * p["body.bn.running_mean"] + 0.1 * mean.detach()
        stats["body.bn.running_var"] = 0.9 * p["body.bn.running_var"] + 0.1 * h.var(0, unbiased=True).detach()
        stats["body.bn.num_batches_tracked"] = p["body.bn.num_batches_tracked"] + 1
    else:
        mean, var = p["body.bn.running_mean"], p["body.bn.running_var"]
    h = torch.tanh((h - mean) / torch.sqrt(var + 1e-5) * p["body.bn.weight"] + p["body.bn.bias"])
    return h @ p["head.weight"].T + p["head.bias"], stats


def fedbn_reference(init: dict, dm, rounds: int, epochs: int, average_bn: bool = False):
    """FedBN Algorithm 1: local SGD on everything; the server averages the non-BN layers only (``average_bn``: the
    role swap, which averages the BN layers and statistics too, i.e. FedAvg)."""
    fed = dm.federated
    glob = dict(init)
    local_bn = [{n: init[n] for n in init if n.startswith("body.bn.")} for _ in range(fed.num_clients)]
    trained = SHARED + BN_PARAMS
    for _ in range(rounds):
        models, sizes = [], []
        for c in range(fed.num_clients):
            x, y = fed.train.client(c)
            p, opt = {**glob, **local_bn[c]}, HeavyBall()
            for _ in range(epochs):
                q = leaves(p, trained)
                logits, stats = tiny_bn_forward(q, x, train=True)
                p = {**opt.step(p, grads(F.cross_entropy(logits, y), q, trained)), **stats}
            models.append(p)
            sizes.append(x.shape[0])
            local_bn[c] = {n: p[n] for n in local_bn[c]}
        names = SHARED + (BN_PARAMS + BN_STATS if average_bn else [])
        glob = {**glob, **weighted_mean(models, sizes, names)}
        if average_bn:
            local_bn = [{n: glob[n] if n in names else b[n] for n in b} for b in local_bn]
    evaluation = []
    for c in range(fed.num_clients):
        x, y = fed.test.client(c)
        evaluation.append(scores(tiny_bn_forward({**glob, **local_bn[c]}, x, train=False)[0], y))
    return glob, local_bn, evaluation


def test_fedbn_keeps_batchnorm_parameters_and_statistics_local_and_averages_the_rest():
    torch.manual_seed(0)
    module, dm, init = fit(FedBN(local_epochs=3), TinyBN(), rounds=2)
    alg, bank = module.algorithm, module.bank
    assert alg.personal == ("body.bn.",)  # found from the network's BatchNorm buffers
    assert set(module.ledger.allowed) == set(SHARED)  # no BN name is ever uploaded
    glob, local_bn, evaluation = fedbn_reference(init, dm, rounds=2, epochs=3)
    net = module.global_params()
    for n in SHARED:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for n in BN_PARAMS + BN_STATS + ["body.bn.num_batches_tracked"]:
        assert torch.equal(net[n], init[n]), n  # the server's BN layer never moves
        for c in range(5):
            assert_close_finite(bank.row(n)[c], local_bn[c][n], **TOL, msg=f"client {c} {n}")
    assert bank.row("body.bn.num_batches_tracked").tolist() == [6] * 5  # 2 rounds × 3 full-batch steps
    assert_evaluation(module, evaluation)  # each client normalises with its own running statistics
    # the role swap (BN averaged like every other layer) is far from it
    swapped, swapped_bn, _ = fedbn_reference(init, dm, rounds=2, epochs=3, average_bn=True)
    assert far(net, swapped, SHARED) > 10 * TOL["atol"]
    assert max(far(bank.get(c), swapped_bn[c], BN_PARAMS + BN_STATS) for c in range(5)) > 1e-2


def test_fedbn_needs_a_batchnorm_network():
    with pytest.raises(ConfigError, match=r"FedBN needs a network with BatchNorm layers"):
        fit(FedBN(), DigitsMLP(hidden=(16,)), rounds=1)


def test_fedbn_batchnorm_state_survives_checkpoint_resume(tmp_path):
    """The clients' BatchNorm statistics (float and integer buffers) are checkpointed with the bank."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(rounds, ckpt_path=None, **trainer_kw):
        torch.manual_seed(0)
        module = FederatedModule(FedBN(), DigitsCNN(batchnorm=True), eval_every=100, eval_last=1)
        dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
        make_trainer(rounds, **trainer_kw).fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module

    full = run(4)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    run(4, enable_checkpointing=True, callbacks=[ckpt])
    resumed = run(4, ckpt_path=str(tmp_path / "r2.ckpt"))
    counts = full.bank.row("body.bn1.num_batches_tracked")
    assert counts.dtype == torch.long and len(set(counts.tolist())) > 1  # clients trained different amounts
    for n in full.bank.names:
        assert torch.equal(resumed.bank.row(n), full.bank.row(n)), n
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n


# -- FedBN -------------------------------------------------------------------------------------------------------
def test_fedbn_defaults_to_one_local_epoch_and_keeps_given_personal_prefixes() -> None:
    assert FedBN().local_epochs == 1
    alg = FedBN(personal=["head."])
    assert alg.personal == ("head.",)
    params = {
        "body.bn1.weight": torch.ones(2),
        "body.bn1.running_mean": torch.zeros(2),
        "body.fc.weight": torch.ones(2, 2),
        "head.weight": torch.ones(1, 2),
    }
    alg.setup(params, 3)
    assert alg.personal == ("head.",)  # not replaced by the BN layers found
    assert alg.is_personal("head.weight") and not alg.is_personal("body.bn1.weight")
    default = FedBN()
    default.setup(params, 3)
    assert default.personal == ("body.bn1.",)
