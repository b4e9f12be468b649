"""FedIT (``fl_lightning/algorithms/fedit.py``) on a tiny BERT with LoRA: the client update is plain SGD on A, B and
the head, and a round through the engine is FedAvg over A and B (and the head), weighted by sample counts."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.algorithms.fedit import FedIT
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.lora_refs import assert_close, context, params_of, prepared, reference_sgd
from tests.helpers.lora_runs import module, text_data
from tests.helpers.tiny_lora import tiny_net, token_batch
from tests.helpers.training import fit


def trained(net) -> list[str]:
    return [n for n, p in net.named_parameters() if p.requires_grad]


def test_client_update_is_sgd_on_both_lora_factors_and_the_head():
    net = tiny_net()
    x, y = token_batch(8), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    glob = params_of(net)
    upd = prepared(FedIT(local_epochs=2), net).client_update(context(net, x, y), glob, {})
    want = reference_sgd(net, glob, x, y, lambda n: ".lora_" in n or n.startswith("head."), 2)
    names = trained(net)
    assert set(upd.upload) == set(names) and upd.state == {}
    assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
    assert_close(upd.upload, want, names)
    assert not torch.equal(upd.upload[names[0]], glob[names[0]])  # it trained


def test_a_round_is_fedavg_over_a_and_b(tmp_path):
    dm = text_data(tmp_path, clients=3)
    net = tiny_net()
    start = params_of(net)
    run = fit(module(FedIT(local_epochs=1), net), dm, rounds=1, limit_val_batches=0)
    fed = dm.federated
    sizes = fed.train.sizes.double()
    expected = {n: torch.zeros_like(start[n], dtype=torch.float64) for n in trained(net)}
    for c in range(3):
        x, y = fed.train.client(c)
        client = reference_sgd(tiny_net(), start, x, y, lambda n: ".lora_" in n or n.startswith("head."), 1)
        for n in expected:
            expected[n] += sizes[c] / sizes.sum() * client[n].double()
    now = params_of(run.net)
    assert_close({n: now[n].double() for n in expected}, expected, expected, rtol=1e-5, atol=1e-6)
    base = [n for n, p in run.net.named_parameters() if not p.requires_grad]
    assert base and all(torch.equal(now[n], start[n]) for n in base)  # the frozen base never moves


def test_a_network_without_adapters_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="LoRA") as err:
        FedIT().check_compatible(DigitsMLP(), 10)
    assert "\n" not in str(err.value)
