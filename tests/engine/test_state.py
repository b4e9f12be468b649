"""``fl_lightning/engine/state.py``: ``ClientStateBank`` rows (template, ``get``/``gather``), bytes per client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_lightning.engine.state import STEPS, ClientStateBank, split_state, state_name
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


# ---- placements (model.client_state, issue 28) ---------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_host_and_disk_banks_answer_as_the_device_bank(placement: str, tmp_path) -> None:
    """Random scatters, then gather / get of written and never-written rows: exactly the device bank's values, on
    the module's device, in the bank's dtypes; the disk bank lives in its folder."""
    rng = np.random.default_rng(1)
    device = ClientStateBank(template(), 30)
    other = ClientStateBank(template(), 30, placement, tmp_path / "bank")
    for _ in range(4):
        ids = torch.from_numpy(rng.choice(30, size=6, replace=False))
        values = {n: torch.from_numpy(rng.normal(size=(6, *t.shape))) for n, t in template().items()}
        device.scatter(ids, values)
        other.scatter(ids, values)
    probe = torch.tensor([0, 5, 29, 5, 11])
    pairs = [(device.gather(probe), other.gather(probe)), (device.get(3), other.get(3)), (device.get(0), other.get(0))]
    for a, b in pairs:
        assert sorted(a) == sorted(b)
        for n in a:
            assert b[n].dtype == a[n].dtype and b[n].device == a[n].device
            torch.testing.assert_close(b[n], a[n], rtol=0, atol=0)
    for n in template():
        torch.testing.assert_close(other.row(n), device.row(n), rtol=0, atol=0)
    assert other.bytes_per_client() == device.bytes_per_client()
    assert (placement == "disk") == any((tmp_path / "bank").glob("*.bin"))


def test_auto_placement_follows_the_documented_rule(monkeypatch) -> None:
    from fl_lightning.engine import state
    from fl_lightning.engine.state import AUTO_DEVICE_BYTES, choose_placement
    from fl_lightning.errors import ConfigError

    monkeypatch.setattr(state, "memory_available", lambda: 10 * 2**30)
    assert choose_placement("auto", AUTO_DEVICE_BYTES) == "device"
    assert choose_placement("auto", AUTO_DEVICE_BYTES + 1) == "host"
    assert choose_placement("auto", 5 * 2**30) == "host"
    assert choose_placement("auto", 5 * 2**30 + 1) == "disk"
    assert choose_placement("auto", 5 * 2**30, world_size=2) == "device"
    assert choose_placement("disk", 1) == "disk"
    with pytest.raises(ConfigError, match="^model.client_state host runs on one process"):
        choose_placement("host", 1, world_size=2)
    with pytest.raises(ConfigError, match="^model.client_state must be auto, device, host or disk, got 'gpu'"):
        choose_placement("gpu", 1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("placement", ["host", "disk"])
@pytest.mark.parametrize("method", ["fedrep", "ditto"])
def test_a_fit_with_each_placement_equals_the_device_placement(
    placement: str, method: str, accelerator: str, tmp_path
) -> None:
    """Three rounds and an evaluation of every client: the global model, every client's state and every client's
    accuracy agree with ``client_state: device`` to 1e-6. On a GPU the host rows are pinned and copied without
    blocking, both ways."""
    from benchmarks.scale import ScaleData
    from fl_lightning.algorithms import Ditto, FedRep
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import DigitsMLP
    from tests.helpers.training import fit

    def run(where: str) -> FederatedModule:
        import lightning as L

        L.seed_everything(0, verbose=False)
        algo = FedRep(head_epochs=1, body_epochs=1) if method == "fedrep" else Ditto(lam=0.5)
        module = FederatedModule(algo, DigitsMLP(hidden=(8,)), lr=0.05, client_state=where, eval_last=0)
        data = ScaleData(num_clients=40, clients_per_round=8)
        return fit(module, data, 3, val_check_interval=3, default_root_dir=str(tmp_path / where),
                   accelerator=accelerator)  # fmt: skip

    ref, got = run("device"), run(placement)
    assert got.bank.placement == placement and ref.bank.placement == "device"
    for (n, p), q in zip(ref.net.named_parameters(), got.net.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6, msg=n)
    for n in ref.bank.names:
        torch.testing.assert_close(got.bank.row(n), ref.bank.row(n), rtol=0, atol=1e-6)
    accuracy = got.last_evaluation.acc_per_client
    torch.testing.assert_close(accuracy, ref.last_evaluation.acc_per_client, rtol=0, atol=1e-6)


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_a_dtype_change_converts_host_and_disk_tables_and_keeps_their_rows(placement: str, tmp_path) -> None:
    """``trainer.precision: 64-true`` converts the module after the bank is built: the tables follow, written
    rows kept (a float64 reference by hand)."""
    bank = ClientStateBank(template(), 5, placement, tmp_path / "bank")
    bank.scatter(torch.tensor([2]), {"fc.weight": torch.full((1, 2, 3), 0.5), "fc.bias": torch.ones(1, 2),
                                     "steps": torch.tensor([9])})  # fmt: skip
    bank.double()
    rows = bank.gather(torch.tensor([2, 4]))
    assert rows["fc.weight"].dtype == torch.float64 and rows["steps"].dtype == torch.int64
    expected = np.stack([np.full((2, 3), 0.5), np.arange(6, dtype=np.float64).reshape(2, 3)])
    np.testing.assert_array_equal(rows["fc.weight"].numpy(), expected)
    np.testing.assert_array_equal(rows["steps"].numpy(), [9, 3])


def test_the_kept_states_names_and_their_split_from_the_algorithms_state() -> None:
    """``client_optimizer.<key>.<parameter>``; ``split_state`` separates those from the algorithm's own entries."""
    assert state_name("momentum_buffer", "body.0.weight") == "client_optimizer.momentum_buffer.body.0.weight"
    assert state_name(STEPS, "w") == "client_optimizer.steps.w"
    state = {"head.weight": torch.ones(2), state_name("exp_avg", "w"): torch.zeros(2), "v.w": torch.ones(1)}
    mine, kept = split_state(state)
    assert set(mine) == {"head.weight", "v.w"} and set(kept) == {"client_optimizer.exp_avg.w"}
    assert all(a is state[n] for part in (mine, kept) for n, a in part.items())
