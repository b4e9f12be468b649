"""``benchmarks.round_overhead``: the clients' CPU time is charged inside ``FederatedModule.run_clients`` only (and the
method is put back), and the command prints one row per executor whose parts add up."""

from __future__ import annotations

import time

import pytest

from benchmarks import round_overhead
from fl_lightning.engine.module import FederatedModule


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_client_seconds_charges_run_clients_and_puts_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FederatedModule, "run_clients", lambda self, seconds: burn(seconds))
    original = FederatedModule.run_clients
    with round_overhead.client_seconds() as spent:
        FederatedModule.run_clients(None, 0.1)
        burn(0.1)  # outside run_clients: not charged
    assert 0.1 <= spent[0] < 0.18
    assert FederatedModule.run_clients is original


def test_each_client_takes_one_minibatch() -> None:
    """The workload's premise: the batch size is above every digits client's training rows."""
    from datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0)
    dm.setup()
    sizes = dm.federated.train.host_sizes(list(range(20)))
    batch = int(round_overhead.OVERRIDES[round_overhead.OVERRIDES.index("--model.batch_size") + 1])
    assert 0 < max(sizes) <= batch


@pytest.mark.slow
def test_the_command_prints_a_row_per_executor(capsys: pytest.CaptureFixture[str]) -> None:
    assert round_overhead.main(["--rounds", "2", "--base", "1", "--repeats", "1", "--executors", "sequential"]) == 0
    out = capsys.readouterr().out.splitlines()
    row = next(line for line in out if line.startswith("sequential"))
    whole, clients, framework = map(float, row.split()[1:])
    assert clients > 0 and whole == pytest.approx(clients + framework, abs=0.02)
