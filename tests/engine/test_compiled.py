"""``model.compile`` (``fl_lightning.engine.compiled``): the stacked path's steps compiled or graph-captured give the
eager path's numbers (``rtol = atol = 1e-5``, the CUDA equality tests'), compile once per shape, and bad settings stop
with one line. ``compile`` runs on the CPU; ``cudagraphs`` (CUDA graphs) only in the ``-m gpu`` tests."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedProx
from fl_lightning.engine import compiled, stacked
from fl_lightning.engine.host_syncs import count_host_reads
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.training import make_trainer, train_here

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, CLIENTS, PER_ROUND = 2, 5, 3


def counters() -> dict[str, int]:
    import torch._dynamo.utils

    return dict(torch._dynamo.utils.counters["stats"])


def reset_dynamo() -> None:
    """A fresh start: no compiled code cached, counters at zero."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def fit(algorithm, network, compile_mode: str, accelerator: str = "cpu", rounds: int = ROUNDS) -> FederatedModule:
    """A short stacked fit on a few digits clients (``model.executor: vectorized``), validation off."""
    L.seed_everything(0, verbose=False)
    module = FederatedModule(algorithm, network(), executor="vectorized", compile=compile_mode, momentum=0.5)
    dm = DigitsDataModule(num_clients=CLIENTS, partition=Shards(2), clients_per_round=PER_ROUND, seed=0)
    make_trainer(rounds, accelerator=accelerator, limit_val_batches=0).fit(module, datamodule=dm)
    return module


def assert_same_run(fast: FederatedModule, eager: FederatedModule) -> None:
    for n, p in eager.global_params().items():
        assert torch.allclose(fast.global_params()[n], p, rtol=1e-5, atol=1e-5), n
    assert fast.bank.names == eager.bank.names
    for n in eager.bank.names:
        assert torch.allclose(fast.bank.row(n), eager.bank.row(n), rtol=1e-5, atol=1e-5), n


# ---- settings -----------------------------------------------------------------------------------------------------
def test_a_mode_that_does_not_exist_is_one_config_error_line() -> None:
    with pytest.raises(ConfigError, match="model.compile must be one of none, compile, cudagraphs, got 'fast'"):
        FederatedModule(FedAvg(1), DigitsMLP(), compile="fast")


def test_cudagraphs_on_the_cpu_stops_at_its_first_step_and_train_py_refuses_it_when_parsing(tmp_path, capsys) -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(), compile="cudagraphs")
    dm = DigitsDataModule(num_clients=CLIENTS, partition=Shards(2), clients_per_round=PER_ROUND, seed=0)
    with pytest.raises(ConfigError, match="cudagraphs captures CUDA graphs and the run is on cpu; use model.compile"):
        make_trainer(1, limit_val_batches=0).fit(module, datamodule=dm)
    assert module.rounds_trained == 0
    run_dir = tmp_path / "run"
    code = train_here(["--config", str(ROOT / "configs" / "quickstart.yaml"), "--trainer.accelerator", "cpu",
                       "--model.compile", "cudagraphs", "--run_dir", str(run_dir)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "model.compile" in err and "needs a CUDA device" in err and "Traceback" not in err, err
    assert not run_dir.exists()  # refused before anything was written


def test_none_hands_back_the_step_itself_and_the_mode_belongs_to_the_network(monkeypatch) -> None:
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # no code generation: fast
    net, other = DigitsMLP(), DigitsMLP()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    assert compiled.mode_of(net) == "none" and compiled.compiled_step(step, net) is step
    FederatedModule(FedAvg(1), net, compile="compile")
    assert compiled.mode_of(net) == "compile" and compiled.mode_of(other) == "none"
    assert compiled.compiled_step(step, net) is not step
    assert torch.equal(compiled.compiled_step(step, net)(torch.zeros(3)), torch.ones(3))


# ---- the same numbers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("network", [lambda: DigitsMLP(hidden=(16,)), DigitsCNN], ids=["mlp", "cnn"])
def test_a_captured_stacked_fit_equals_the_eager_one_and_compiles_once(network, monkeypatch) -> None:
    """dynamo's capture of the stacked step (``aot_eager``: the graph ``compile`` hands to TorchInductor, run by
    eager kernels, so that the test is fast): the same numbers after 2 rounds of FedProx (a penalty in the step),
    the CNN through the ``vmap``-ed step (``CONV_CLIENTS`` set to ``vmap`` as on accelerators), the MLP through the
    batched-matmul one; the second round compiles nothing new."""
    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")
    monkeypatch.setitem(stacked.CONV_CLIENTS, "cpu", "vmap")
    reset_dynamo()
    eager = fit(FedProx(mu=0.1), network, "none")
    assert counters().get("unique_graphs", 0) == 0
    one = fit(FedProx(mu=0.1), network, "compile", rounds=1)
    graphs = counters()["unique_graphs"]
    assert graphs >= 1  # the step was captured
    captured = fit(FedProx(mu=0.1), network, "compile")
    assert counters()["unique_graphs"] == graphs  # the same shapes and settings: nothing compiled again
    assert_same_run(captured, eager)
    assert one.rounds_trained == 1


@pytest.mark.slow
def test_an_inductor_compiled_fedavg_round_equals_the_eager_one() -> None:
    """``model.compile: compile`` as a user runs it (TorchInductor's generated CPU kernels; over a minute on 2
    loaded cores, mostly the C++ compiler): 2 rounds of stacked FedAvg on a small MLP."""
    reset_dynamo()
    eager = fit(FedAvg(1), lambda: DigitsMLP(hidden=(16,)), "none")
    fast = fit(FedAvg(1), lambda: DigitsMLP(hidden=(16,)), "compile")
    assert counters()["unique_graphs"] >= 1
    assert_same_run(fast, eager)


# ---- CUDA graphs --------------------------------------------------------------------------------------------------
@pytest.fixture
def ieee_fp32():
    """TF32 off, as in the CUDA equality tests of ``tests/engine/test_executor.py``."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["compile", "cudagraphs"])
@pytest.mark.parametrize("network", [lambda: DigitsMLP(hidden=(16,)), DigitsCNN], ids=["mlp", "cnn"])
def test_a_compiled_or_graph_captured_fit_on_cuda_equals_the_eager_one(network, mode, ieee_fp32) -> None:
    reset_dynamo()
    eager = fit(FedProx(mu=0.1), network, "none", accelerator="gpu")
    fast = fit(FedProx(mu=0.1), network, mode, accelerator="gpu")
    assert counters()["unique_graphs"] >= 1
    assert_same_run(fast, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_captured_rounds_read_nothing_back_inside_the_clients_and_replay(ieee_fp32) -> None:
    """After a warm-up fit, a ``cudagraphs`` fit compiles no new graph (the captured one is replayed), and its
    client work (``run_clients``) reads nothing back to the host."""
    reset_dynamo()
    fit(FedAvg(1), DigitsCNN, "cudagraphs", accelerator="gpu")
    graphs = counters()["unique_graphs"]
    module = fit(FedAvg(1), DigitsCNN, "cudagraphs", accelerator="gpu")
    assert counters()["unique_graphs"] == graphs
    glob = module.global_params()
    cohort = [0, 1, 2]
    with count_host_reads() as reads:
        module.run_clients(cohort, ROUNDS, glob, [module.bank.get(c) for c in cohort], [1.0] * len(cohort))
    assert reads.count == 0, reads.by_method
