"""``ClientStateBank`` rows: every client starts from the template, ``get``/``gather`` read a client's rows,
``scatter`` writes only the named clients and casts to the bank's dtype, dotted parameter names work, and the
bank round-trips through its ``state_dict``. References: the template and values, repeated by hand in numpy."""

from __future__ import annotations

import numpy as np
import torch
from helpers import assert_close_finite

from fl_lightning.engine.state import ClientStateBank

NUM_CLIENTS = 4


def template() -> dict[str, torch.Tensor]:
    return {
        "fc.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "fc.bias": torch.tensor([1.5, -2.0]),
        "steps": torch.tensor(3, dtype=torch.int64),
    }


def test_every_client_starts_from_the_template_and_scatter_writes_only_its_clients() -> None:
    bank = ClientStateBank(template(), NUM_CLIENTS)
    assert bank.num_clients == NUM_CLIENTS  # the module compares it with the data's client count on setup
    ref = {n: np.stack([t.numpy()] * NUM_CLIENTS) for n, t in template().items()}
    for n in ref:
        assert bank.row(n).shape == ref[n].shape and bank.row(n).dtype == template()[n].dtype
        assert_close_finite(bank.row(n), ref[n])
    clients = torch.tensor([3, 1])
    values = {  # float64 values into the float32 / int64 rows: cast to the bank's dtypes
        "fc.weight": torch.full((2, 2, 3), 0.25, dtype=torch.float64) * torch.tensor([1.0, 2.0]).view(2, 1, 1),
        "fc.bias": torch.tensor([[7.0, 8.0], [9.0, 10.0]], dtype=torch.float64),
        "steps": torch.tensor([5.0, 6.0], dtype=torch.float64),
    }
    bank.scatter(clients, values)
    for n, v in values.items():
        ref[n][[3, 1]] = v.numpy()
        assert bank.row(n).dtype == template()[n].dtype
        assert_close_finite(bank.row(n), ref[n])
    for c in range(NUM_CLIENTS):
        for n, t in bank.get(c).items():
            assert_close_finite(t, ref[n][c])
    picked = bank.gather(torch.tensor([1, 0]))
    assert sorted(picked) == sorted(ref)
    for n, t in picked.items():
        assert_close_finite(t, ref[n][[1, 0]])


def test_state_dict_round_trip_and_checkpoint_key_format() -> None:
    """Checkpoint keys are the state names with every "." written as "__" (buffer names cannot hold dots), so
    a checkpoint saved earlier keeps loading."""
    bank = ClientStateBank(template(), NUM_CLIENTS)
    bank.scatter(torch.tensor([2]), {n: (t + 1).unsqueeze(0) for n, t in template().items()})
    assert sorted(bank.state_dict()) == sorted(n.replace(".", "__") for n in template())
    fresh = ClientStateBank(template(), NUM_CLIENTS)
    fresh.load_state_dict(bank.state_dict())
    for n, t in template().items():
        assert_close_finite(fresh.row(n)[2], t.numpy() + 1)
        assert_close_finite(fresh.row(n)[0], t.numpy())
