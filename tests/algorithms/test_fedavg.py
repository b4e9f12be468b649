"""FedAvg (McMahan et al. 2017; ``fl_lightning/algorithms/fedavg.py``) against references written here: its arguments
and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import copy

import lightning as L
import torch

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite, assert_params_close_finite
from tests.helpers.digits_mlp import assert_params_close, context, reference_sgd
from tests.helpers.digits_runs import digits
from tests.helpers.heavy_ball_mlp import TinyBN, fit
from tests.helpers.split_models import LR, NAMES, far, rand_params
from tests.helpers.split_models import reference_sgd as reference_sgd_2
from tests.helpers.training import make_trainer


def test_fedavg_client_update(digits_mlp_setup):
    net, x, y, glob, _ = digits_mlp_setup
    upd = FedAvg(local_epochs=3).client_update(context(net, x, y), glob, {})
    expected = reference_sgd(net, x, y, [""], 3)
    assert set(upd.upload) == set(glob) and upd.state == {} and upd.num_samples == len(x)
    assert_params_close(upd.upload, expected, glob)


def test_fedavg_on_a_batchnorm_network_still_averages_the_statistics():
    """The engine's default: without FedBN, BN layers and their statistics are shared like any other layer."""
    torch.manual_seed(0)
    module, _, init = fit(FedAvg(local_epochs=1), TinyBN(), rounds=1)
    assert {"body.bn.running_mean", "body.bn.num_batches_tracked"} <= set(module.ledger.allowed)
    assert not torch.equal(module.global_params()["body.bn.running_mean"], init["body.bn.running_mean"])


def test_fedavg_client_update_is_local_sgd_from_the_global_model(client):
    ctx, x, y = client
    glob = rand_params(1)
    upd = FedAvg(local_epochs=3).client_update(ctx(), glob, {})
    want = reference_sgd_2(glob, x, y, NAMES, 3)
    assert list(upd.upload) == NAMES and upd.state == {} and upd.num_samples == 8
    assert_params_close_finite(upd.upload, want, rtol=1e-9, atol=1e-10)
    ascent = reference_sgd_2(glob, x, y, NAMES, 3, lr=-LR)  # sign of the step
    no_momentum = reference_sgd_2(glob, x, y, NAMES, 3, momentum=0.0)
    assert far(upd.upload, ascent) and far(upd.upload, no_momentum)


def test_fedavg_one_client_one_step_equals_sgd():
    L.seed_everything(0, verbose=False)
    net = DigitsMLP()
    reference = copy.deepcopy(net)
    dm = digits(num_clients=1, clients_per_round=1)
    module = FederatedModule(FedAvg(local_epochs=1), net, lr=0.1, momentum=0.0, batch_size=10_000, eval_every=100)
    make_trainer(1).fit(module, datamodule=dm)

    x, y = dm.federated.train.client(0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()
    for (n, p), (_, q) in zip(module.net.named_parameters(), reference.named_parameters()):
        assert_close_finite(p, q, rtol=1e-5, atol=1e-6, msg=n)
