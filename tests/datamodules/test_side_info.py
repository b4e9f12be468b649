"""``datamodules/side_info.py``: the side-information providers (one-hot shift group, one-hot client, noisy and
missing variants, the learned client embedding) against references written here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from datamodules import (
    ClientEmbedding,
    ClientOneHot,
    DigitsShiftDataModule,
    MissingSideInfo,
    NoisySideInfo,
    ShiftOneHot,
)
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite


def fake_federation(num_clients: int) -> FederatedData:
    x = torch.zeros(num_clients, 1)
    split = ClientSplit(x, torch.zeros(num_clients, dtype=torch.long), torch.arange(num_clients + 1))
    return FederatedData(split, split, 2, extras={"shift_group": torch.arange(num_clients) % 4})


def test_one_hot_noisy_and_missing_side_information():
    fed = fake_federation(400)
    rng = np.random.default_rng(0)
    one_hot = ShiftOneHot(4)(fed, rng)
    assert torch.equal(one_hot, F.one_hot(torch.arange(400) % 4, 4).float())
    assert torch.equal(ClientOneHot()(fed, rng), torch.eye(400))
    noisy = NoisySideInfo(ShiftOneHot(4), std=0.5)(fed, np.random.default_rng(1))
    assert abs(float((noisy - one_hot).std()) - 0.5) < 0.03 and abs(float((noisy - one_hot).mean())) < 0.03
    missing = MissingSideInfo(ShiftOneHot(4), fraction=0.25)(fed, np.random.default_rng(2))
    blank = missing.abs().sum(1) == 0
    assert int(blank.sum()) == 100 and torch.equal(missing[~blank], one_hot[~blank])
    mean_fill = MissingSideInfo(ShiftOneHot(4), fraction=0.25, fill="mean")(fed, np.random.default_rng(2))
    assert_close_finite(mean_fill[blank], one_hot[~blank].mean(0).expand(100, 4))
    with pytest.raises(ConfigError, match="needs a feature shift"):
        ShiftOneHot()(FederatedData(fed.train, fed.test, 2), rng)


def test_client_embedding_is_the_mean_body_output_of_a_centrally_trained_group_classifier():
    provider = ClientEmbedding(group="shift_group", epochs=2, lr=0.05, width=8)
    dm = DigitsShiftDataModule(num_clients=8, seed=0, side=provider)
    dm.setup("fit")
    fed, net = dm.federated, provider.trained_network
    assert fed.side.shape == (8, 8)  # width 8, 16×16 → 1×1 after four pools
    assert net.head.out_features == 4  # a 4-way group (shift) classifier
    net.eval()
    with torch.no_grad():
        for c in range(8):
            xc, _ = fed.train.client(c)
            assert_close_finite(fed.side[c], net.body(xc).mean(0), rtol=1e-4, atol=1e-5)
    assert provider.train_accuracy > 0.5  # it learned to tell the shift groups apart (chance: 0.25)
    with pytest.raises(ConfigError, match="alphabet"):
        DigitsShiftDataModule(num_clients=4, seed=0, side=ClientEmbedding(epochs=0)).setup("fit")
