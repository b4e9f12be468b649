"""Issue 31. ``model.drop_last``: the clients' local SGD skips every partial minibatch, in both executors; a
BatchNorm1d network runs on a partition with 1-sample remainders (drop_last on: those batches are dropped; off:
the 1-sample batch is skipped and the run says so once; batch size 1 is refused with one line). The summary keeps
plain and "+FT" figures under separate names (the report's columns and flags: ``tests/experiment/test_report.py``)."""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedBN, FedRoD, PFedMe
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule, FineTune
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.training import make_trainer


# ---- one client's local SGD -----------------------------------------------------------------------------------------
def test_client_sgd_with_drop_last_steps_on_the_full_batches_only() -> None:
    """23 samples, batch 5, plain SGD: drop_last takes the 4 full batches of the epoch's shuffle (``randperm`` of
    the client's generator), as ``DataLoader(drop_last=True)``; without it the 3-sample rest steps too."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(23, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (23,), generator=g)
    net = SplitModel(nn.Identity(), nn.Linear(4, 3)).double()
    p0 = {n: t.detach().clone() for n, t in net.named_parameters()}
    lr, bs = 0.3, 5

    def run(drop_last: bool) -> tuple[dict, int]:
        opt = ClientOptimizer(lr=lr, momentum=0.0, batch_size=bs, drop_last=drop_last)
        ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(3, "train", 0, 0))
        return ctx.sgd(p0, list(p0), 1), int(ctx.steps_taken)

    def reference(keep_partial: bool) -> dict:
        perm = torch.randperm(23, generator=make_generator(3, "train", 0, 0))
        w, b = p0["head.weight"].clone(), p0["head.bias"].clone()
        for i in range(0, 23, bs):
            idx = perm[i : i + bs]
            if len(idx) < bs and not keep_partial:
                continue
            w.requires_grad_(True), b.requires_grad_(True)
            loss = F.cross_entropy(x[idx] @ w.T + b, y[idx])
            gw, gb = torch.autograd.grad(loss, [w, b])
            w, b = (w - lr * gw).detach(), (b - lr * gb).detach()
        return {"head.weight": w, "head.bias": b}

    dropped, steps = run(True)
    kept, steps_all = run(False)
    assert (steps, steps_all) == (4, 5)
    for name, want in reference(keep_partial=False).items():
        assert_close_finite(dropped[name], want)
    for name, want in reference(keep_partial=True).items():
        assert_close_finite(kept[name], want)
    assert float((dropped["head.weight"] - kept["head.weight"]).abs().max()) > 1e-3


# ---- sequential = stacked ------------------------------------------------------------------------------------------
def digits() -> DigitsDataModule:
    return DigitsDataModule(num_clients=5, partition=Shards(2), participation=1.0, seed=0)


def train(executor: str, drop_last: bool, batch_size: int = 40, network: nn.Module | None = None, algorithm=None):
    torch.manual_seed(0)
    module = FederatedModule(
        algorithm or FedAvg(1), network or DigitsMLP(hidden=(16,)), lr=0.05, momentum=0.5, batch_size=batch_size,
        eval_every=1, eval_last=1, executor=executor, drop_last=drop_last,
    )  # fmt: skip
    make_trainer(1).fit(module, datamodule=digits())
    return module


@pytest.mark.parametrize("algorithm", [FedAvg, PFedMe, FedRoD], ids=lambda a: a.__name__)
def test_sequential_and_vectorized_executors_agree_with_drop_last(algorithm: type) -> None:
    """Client sizes 290, 285, 288, 287, 288 and batch 40: every client has a partial last batch. pFedMe's
    personal steps and FedRoD's two heads run through the same client SGD, so drop_last reaches them too."""
    seq, vec = train("sequential", True, algorithm=algorithm()), train("vectorized", True, algorithm=algorithm())
    plain = train("sequential", False, algorithm=algorithm())
    for name, value in seq.global_params().items():
        assert_close_finite(vec.global_params()[name], value, rtol=2e-4, atol=2e-5)
    diff = max(float((seq.global_params()[n] - plain.global_params()[n]).abs().max()) for n in plain.global_params())
    assert diff > 1e-4  # drop_last changed the training


# ---- BatchNorm1d ---------------------------------------------------------------------------------------------------
class BNMLP(SplitModel):
    """64 → fc 8 → BatchNorm1d → ReLU → head 10: a BatchNorm1d cannot train on a 1-sample batch."""

    def __init__(self) -> None:
        layers = OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(64, 8), bn=nn.BatchNorm1d(8), act=nn.ReLU())
        body = nn.Sequential(layers)
        super().__init__(body, nn.Linear(8, 10))


BATCH = 7  # client sizes 290, 285, 288, 287, 288: remainders 3, 5, 1, 0, 1 → clients 2 and 4 end on 1 sample


def expected_bn_batches(drop_last: bool, rounds: int = 1) -> list[int]:
    """BatchNorm1d counts one tracked batch per training step: full batches, plus the rest if it is kept."""
    sizes = [290, 285, 288, 287, 288]
    return [rounds * (n // BATCH + (0 if drop_last or n % BATCH < 2 else 1)) for n in sizes]


def test_the_partition_has_one_sample_remainders() -> None:
    dm = digits()
    dm.setup()
    sizes = [dm.federated.train.client(c)[0].shape[0] for c in range(5)]
    assert [n % BATCH for n in sizes].count(1) == 2


@pytest.mark.parametrize("drop_last", [True, False])
def test_fedbn_with_batchnorm1d_trains_on_one_sample_remainders(drop_last: bool, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        module = train("sequential", drop_last, BATCH, BNMLP(), FedBN(local_epochs=1))
    tracked = module.bank.row("body.bn.num_batches_tracked").tolist()
    assert tracked == expected_bn_batches(drop_last)
    skipped = [r.getMessage() for r in caplog.records if "1 sample is skipped" in r.getMessage()]
    assert len(skipped) == (0 if drop_last else 1)  # said once, not per client or round
    assert all(torch.isfinite(v).all() for v in module.global_params().values())


def test_batch_size_one_with_batchnorm1d_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^model.batch_size 1 with a BatchNorm1d network: .*at least 2$"):
        FederatedModule(FedBN(), BNMLP(), batch_size=1)


# ---- summary.json: plain and "+FT" under separate names --------------------------------------------------------------
def test_summary_keeps_the_plain_figures_plain_with_finetune() -> None:
    """final/last10/best come from the per-round validation history (plain); final_ft is the "+FT" evaluation."""
    torch.manual_seed(0)
    module = FederatedModule(
        FedAvg(1), DigitsMLP(hidden=(16,)), lr=0.05, batch_size=40, eval_every=1, eval_last=2,
        finetune=FineTune(epochs=3),
    )  # fmt: skip
    make_trainer(3).fit(module, datamodule=digits())
    s, accs = module.summary, [h["val/acc_mean"] for h in module.history]
    assert s["algorithm"] == "FedAvg+FT" and s["classes"] == 10
    assert s["final"] == accs[-1] and s["best"] == max(accs)
    assert s["last10"] == pytest.approx(sum(accs[-2:]) / 2)
    ft = module.finetuned_clients
    assert s["final_ft"] == pytest.approx(float(ft.acc_per_client.mean()))  # 5 clients, all with test data
    assert s["final_ft"] != s["final"] and s["final_ft_min"] == pytest.approx(float(ft.acc_per_client.min()))
    assert s["final_min"] == pytest.approx(float(module.last_evaluation.acc_per_client.min()))
    assert "plain_final" not in s and "plain_last10" not in s
    # the collapse check: pooled predictions of the global model over every client's test split, by hand
    fed, glob = module.fed, module.global_params()
    x, y = fed.test.x, fed.test.y
    with torch.no_grad():
        pred = torch.func.functional_call(module.net.eval(), glob, (x,)).argmax(-1)
    assert s["top_class_share"] == pytest.approx(np.bincount(pred.numpy(), minlength=10).max() / len(y))
    assert s["label_top_class_share"] == pytest.approx(np.bincount(y.numpy(), minlength=10).max() / len(y))
