"""FLoRA (``fl_lightning/algorithms/flora.py``): stacking aggregation. Through the engine, one round moves every
adapted base weight by exactly s·B A with A = [p₁A₁; …; p_KA_K] and B = [B₁ … B_K] stacked here from the clients'
factors (trained by a plain-torch reference from each client's fresh adapter), to 1e-6, with equal ranks and with
different ranks (a rank-rᵢ client: the first rᵢ rows of A and columns of B)."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.algorithms.flora import FLoRA
from fl_lightning.algorithms.lora_common import lora_layers
from fl_lightning.errors import ConfigError
from tests.helpers.lora_refs import context, params_of, prepared, reference_sgd
from tests.helpers.lora_runs import module, text_data
from tests.helpers.tiny_lora import tiny_net
from tests.helpers.training import fit

RANK = 4
LR_BIG = 2.0  # B starts at zero: a large step makes the merged update large against the 1e-6 tolerance


def test_fresh_adapter_follows_peft_init_and_the_clients_rank():
    net = tiny_net(rank=RANK)
    alg = prepared(FLoRA(ranks=[2, 3]), net)
    glob = params_of(net)
    x, y = torch.ones(2, 8, dtype=torch.long), torch.tensor([0, 1])
    fresh = alg.fresh_adapter(context(net, x, y, client=1, round_idx=5, seed=9), glob)
    again = alg.fresh_adapter(context(net, x, y, client=1, round_idx=5, seed=9), glob)
    other = alg.fresh_adapter(context(net, x, y, client=1, round_idx=6, seed=9), glob)
    for a, b, _, _ in lora_layers(net).values():
        bound = 1 / fresh[a].shape[1] ** 0.5
        assert fresh[a][:3].abs().max() <= bound and fresh[a][:3].abs().min() > 0  # client 1: rank 3
        assert torch.all(fresh[a][3:] == 0) and torch.all(fresh[b] == 0)
        assert torch.equal(fresh[a], again[a]) and not torch.equal(fresh[a], other[a])


@pytest.mark.parametrize("ranks", [None, [4, 2, 3]], ids=["equal_ranks", "different_ranks"])
def test_one_round_merges_exactly_the_stacked_product(tmp_path, ranks):
    dm = text_data(tmp_path, clients=3)
    net = tiny_net(rank=RANK)
    start = params_of(net)
    alg = FLoRA(local_epochs=4, ranks=ranks)
    run = fit(module(alg, net, lr=LR_BIG), dm, rounds=1, limit_val_batches=0)
    fed, layers = dm.federated, lora_layers(run.net)
    p = fed.train.sizes.double() / fed.train.sizes.sum()
    factors = []
    for c in range(3):  # each client's factors: the plain-torch SGD from its fresh adapter
        x, y = fed.train.client(c)
        ctx = context(tiny_net(rank=RANK), x, y, client=c, round_idx=0, seed=fed.seed)
        fresh = alg.fresh_adapter(ctx, start)
        trains = lambda n: ".lora_" in n or "head." in n  # noqa: E731
        factors.append(reference_sgd(tiny_net(rank=RANK), fresh, x, y, trains, 4, lr=LR_BIG))
    now = params_of(run.net)
    for a, b, base, s in layers.values():
        r = [RANK if ranks is None else ranks[c] for c in range(3)]
        stacked_a = torch.cat([p[c] * factors[c][a][: r[c]].double() for c in range(3)])  # [Σ r, d_in]
        stacked_b = torch.cat([factors[c][b][:, : r[c]].double() for c in range(3)], dim=1)  # [d_out, Σ r]
        assert stacked_a.shape[0] == sum(r)
        want = start[base].double() + s * stacked_b @ stacked_a
        assert (now[base].double() - want).abs().max() < 1e-6, base
        assert (now[base] - start[base]).abs().max() > 1e-4  # it moved: 100x the tolerance
        for c in range(3):  # a rank-rᵢ client's extra rows and columns stayed zero
            assert torch.all(factors[c][a][r[c] :] == 0) and torch.all(factors[c][b][:, r[c] :] == 0)


def test_ranks_above_the_networks_rank_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="rank") as err:
        prepared(FLoRA(ranks=[8]), tiny_net(rank=RANK))
    assert "\n" not in str(err.value)

