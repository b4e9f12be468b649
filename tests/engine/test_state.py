"""``fl_lightning/engine/state.py``: ``ClientStateBank`` rows (template, ``get``/``gather``), bytes per client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.engine.state import ClientStateBank
from tests.helpers.asserts import assert_close_finite

TEMPLATE_SPEC = {
    "w": ((2, 3), np.float32),
    "steps": ((4,), np.int64),
    "scale": ((), np.float64),
    "h": ((5,), np.float16),
}


def expected_bytes() -> int:
    """Σ over the template of (number of entries) × (bytes per entry), from the spec, not from torch."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for shape, dt in TEMPLATE_SPEC.values())


@pytest.mark.parametrize("num_clients", [1, 3])
def test_bytes_per_client_is_one_clients_template(num_clients: int) -> None:
    template = {n: torch.from_numpy(np.ones(shape, dtype=dt)) for n, (shape, dt) in TEMPLATE_SPEC.items()}
    bank = ClientStateBank(template, num_clients)
    got = bank.bytes_per_client()
    assert isinstance(got, int)
    assert got == expected_bytes() == 6 * 4 + 4 * 8 + 1 * 8 + 5 * 2


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
