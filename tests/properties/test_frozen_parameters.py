"""Frozen parameters (``requires_grad=False``) never train and are never uploaded, in every gradient algorithm; the
closed-form methods refuse them in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fl_lightning.algorithms as algorithms
from fl_lightning.algorithms import FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.digits_mlp import params_of
from tests.helpers.digits_runs import digits
from tests.helpers.training import fit

# ---- frozen parameters ------------------------------------------------------------------------------------------
NEURAL = {
    "FedAvg": lambda: FedAvg(1),
    "FedAvgSteps": lambda: algorithms.FedAvgSteps(5),
    "FedProx": lambda: algorithms.FedProx(0.1),
    "SCAFFOLD": lambda: algorithms.SCAFFOLD(),
    "FedMTL": lambda: algorithms.FedMTL(),
    "PerFedAvg": lambda: algorithms.PerFedAvg(),
    "LGFedAvg": lambda: LGFedAvg(1, personal=("body.fc2.",)),
    "L2GD": lambda: algorithms.L2GD(p=0.5),
    "APFL": lambda: algorithms.APFL(),
    "Ditto": lambda: algorithms.Ditto(),
    "FedPer": lambda: FedPer(1),
    "FedRep": lambda: FedRep(2, 1),
    "LocalOnly": lambda: LocalOnly(1),
    "FedBN": lambda: algorithms.FedBN(),  # on DigitsCNN with BatchNorm (NETWORKS)
    "FedBABU": lambda: algorithms.FedBABU(),
    "FedRoD": lambda: algorithms.FedRoD(),
    "FedALA": lambda: algorithms.FedALA(),
    "PFedMe": lambda: algorithms.PFedMe(inner_steps=2, local_steps=3),
    "FedProto": lambda: algorithms.FedProto(),
    "MOON": lambda: algorithms.MOON(),
    "FedDyn": lambda: algorithms.FedDyn(),
}


NETWORKS = {"FedBN": lambda: DigitsCNN(batchnorm=True)}  # others: DigitsMLP(hidden=(16, 8)); both have body.fc1


CLOSED_FORM = [
    "LinearFedAvg",
    "LinearFedRep",
    "IFCA",
    "FedMD",
    "OneShotClustering",
    "PowerInitLocalGD",
    "AlternatingGD",
]


def test_every_algorithm_is_checked_with_a_frozen_layer():
    exported = {n for n in algorithms.__all__ if n not in ("Algorithm", "ClientUpdate")}
    assert exported == set(NEURAL) | set(CLOSED_FORM)


def observed_fit(module, dm, rounds):
    from tests.helpers.training import fit

    seen: set[str] = set()
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.update(t))

    module.attach_data = attach_and_observe
    fit(module, dm, rounds)
    return seen


@pytest.mark.parametrize("name", sorted(NEURAL))
def test_a_frozen_layer_stays_frozen_in_every_gradient_algorithm(name):
    """``body.fc1`` frozen: the run works, the layer never changes, is never uploaded nor kept per client."""
    from datamodules import DigitsDataModule, Shards
    from fl_lightning.engine.module import FederatedModule

    torch.manual_seed(0)
    net = NETWORKS.get(name, lambda: DigitsMLP(hidden=(16, 8)))()
    net.body.fc1.requires_grad_(False)
    before = params_of(net)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    module = FederatedModule(NEURAL[name](), net, aggregation="uniform", eval_every=100, eval_last=1)
    seen = observed_fit(module, dm, 2)
    frozen = {"body.fc1.weight", "body.fc1.bias"}
    assert 0 <= module.summary["final"] <= 1
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters() if n in frozen)
    assert not seen & frozen and not any(n.endswith(tuple(frozen)) for n in module.bank.names)
    trained_global = any(not torch.equal(p, before[n]) for n, p in net.named_parameters() if n not in frozen)
    assert trained_global or name in ("LocalOnly", "FedProto")  # FedProto uploads prototypes, never parameters
    if name != "LocalOnly":
        assert seen


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_closed_form_algorithms_refuse_a_frozen_parameter_in_one_line(name):
    algorithm = getattr(algorithms, name)()
    with pytest.raises(ConfigError, match=f"{name} updates its parameters in closed form.*body.weight"):
        algorithm.set_frozen(["body.weight"])
    algorithm.set_frozen([])  # nothing frozen: fine


class MeanOfTokens(nn.Module):
    def forward(self, e):
        return e.mean(1)


def token_datamodule(num_clients=4, train=12, test=6, vocab=30, length=5):
    from datamodules.base import FederatedDataModule
    from fl_lightning.engine.client_data import ClientSplit, FederatedData

    g = torch.Generator().manual_seed(0)

    def split(per_client):
        n = num_clients * per_client
        x = torch.randint(0, vocab, (n, length), generator=g)
        y = (x[:, 0] < vocab // 2).long()  # learnable from the first token
        return ClientSplit(x, y, torch.arange(0, n + 1, per_client))

    class Tokens(FederatedDataModule):
        def build(self):
            return FederatedData(split(train), split(test), 2, seed=0)

    return Tokens(num_clients=num_clients, clients_per_round=2, seed=0)


@pytest.mark.parametrize("name", ["Ditto", "APFL", "PerFedAvg"])
def test_ditto_apfl_perfedavg_run_with_a_frozen_embedding(name):
    """The Sent140 setting in small: a frozen (pretrained) embedding under a trainable body and head."""
    from collections import OrderedDict

    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models.split import SplitModel

    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(embed=nn.Embedding(30, 6), pool=MeanOfTokens(), fc=nn.Linear(6, 8), act=nn.Tanh()))
    net = SplitModel(body, nn.Linear(8, 2))
    net.body.embed.weight.requires_grad_(False)
    before = params_of(net)
    module = FederatedModule(NEURAL[name](), net, batch_size=4, eval_every=100, eval_last=1)
    seen = observed_fit(module, token_datamodule(), 3)
    assert torch.equal(net.body.embed.weight, before["body.embed.weight"])
    assert "body.embed.weight" not in seen and seen == {n for n in before if n != "body.embed.weight"}
    assert not any("embed" in n for n in module.bank.names)
    assert not torch.equal(net.body.fc.weight, before["body.fc.weight"]) and 0 <= module.summary["final"] <= 1


def test_frozen_parameters_never_train_and_are_never_uploaded():
    net = DigitsMLP()
    net.body.fc1.weight.requires_grad_(False)
    frozen = net.body.fc1.weight.detach().clone()
    seen: list[str] = []
    module = FederatedModule(FedAvg(1), net, eval_every=100)
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.extend(t))

    module.attach_data = attach_and_observe
    fit(module, digits(), rounds=2)
    assert torch.equal(module.net.body.fc1.weight, frozen)
    assert seen and "body.fc1.weight" not in seen and "body.fc1.bias" in seen
