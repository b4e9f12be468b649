"""``ClientStateBank.bytes_per_client``: one client's share of the bank, in bytes, counted by hand from the
template's shapes and dtypes (numpy item sizes), for a bank of one client and of several."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.engine.state import ClientStateBank

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
