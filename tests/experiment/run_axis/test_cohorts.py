"""``fl_lightning/experiment/run_axis/cohorts.py``: the stacked client updates of several runs' cohorts equal each
run's own clients (per-run server state, kept optimiser state and learning rates, an algorithm that reads the run
seed, each run's own frozen-body features)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.func import functional_call

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.algorithms.base import Algorithm
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler, make_generator
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import per_sample_loss_for
from fl_lightning.experiment.run_axis.cohorts import CohortExecutor, CohortRequest, RunsContext
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite

ALGORITHMS = {
    "fedrep": lambda: FedRep(2, 1),
    "fedavg": lambda: FedAvg(1),
    "fedper": lambda: FedPer(1),
    "lg_fedavg": lambda: LGFedAvg(1, personal=("body.",)),
    "local": lambda: LocalOnly(1),
}


def digits_module(seed: int, algorithm: Algorithm, **kwargs) -> FederatedModule:
    L.seed_everything(seed, verbose=False)
    data = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=seed)
    data.setup()
    module = FederatedModule(algorithm, DigitsMLP(hidden=(32, 16)), batch_size=7, **kwargs)
    module.attach_data(data.federated)
    with torch.no_grad():  # distinct personal states, so that the bank rows matter
        for name in module.bank.names:
            row = module.bank.row(name)
            if row.is_floating_point() and not name.startswith("client_optimizer."):
                row.add_(0.01 * torch.randn(row.shape, generator=torch.Generator().manual_seed(seed)))
    return module


def requests_for(modules: list[FederatedModule], round_idx: int, budgets=None, keys=None) -> list[CohortRequest]:
    """Each module's round as a request; ``keys``: each run's batch key (default: one key, the runs of one job)."""
    out = []
    for m, key in zip(modules, keys or ["one job"] * len(modules)):
        cohort = ClientSampler(m.fed.num_clients, 3, m.fed.seed).sample(round_idx).tolist()
        out.append(
            CohortRequest(m, cohort, round_idx, m.global_params(), [m.bank.get(c) for c in cohort],
                          list(budgets or [1.0] * len(cohort)), key)
        )  # fmt: skip
    return out


def assert_each_equals_its_run_alone(requests: list[CohortRequest], samples_and_loss: bool = False) -> None:
    """Every request trained, and each client's upload and new state equal its run's own ``run_clients`` (the
    sequential loop) to 1e-5; with ``samples_and_loss``, its sample count and training loss too."""
    for req in requests:
        assert req.done and req.error is None
        alone = req.module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)  # sequential
        for got, ref in zip(req.result, alone):
            if samples_and_loss:
                assert got.num_samples == ref.num_samples
                assert abs(got.loss - ref.loss) < 1e-5
            assert set(got.upload) == set(ref.upload) and set(got.state) == set(ref.state)
            for n in ref.upload:
                assert_close_finite(got.upload[n], ref.upload[n], rtol=0, atol=1e-5, msg=n)
            for n in ref.state:
                assert_close_finite(got.state[n], ref.state[n], rtol=0, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_stacked_cohorts_of_three_runs_equal_each_runs_sequential_clients(name):
    modules = [digits_module(s, ALGORITHMS[name]()) for s in (0, 1, 2)]
    requests = requests_for(modules, round_idx=1, budgets=[1.0, 0.4, 1.0])
    CohortExecutor().run(requests)
    assert_each_equals_its_run_alone(requests, samples_and_loss=True)


def test_runs_with_their_own_server_state_share_one_call_each_client_with_its_runs_state():
    """SCAFFOLD's server variate c differs per run; the three runs' clients still train in one stacked call
    (``server_state_broadcasts``), each with its own run's c, and equal each run alone; every run keeps its c."""
    modules = [digits_module(s, SCAFFOLD(1)) for s in (0, 1, 2)]
    for s, m in enumerate(modules):
        for buffer in m.algorithm.buffers():
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=torch.Generator().manual_seed(10 + s)))
    before = [{n: b.clone() for n, b in m.algorithm.named_buffers()} for m in modules]
    assert len(before[0]) > 0 and not torch.equal(next(iter(before[0].values())), next(iter(before[1].values())))
    requests = requests_for(modules, round_idx=1, budgets=[1.0, 0.4, 1.0])
    executor = CohortExecutor()
    executor.run(requests)
    assert executor.calls == 1
    for m, kept in zip(modules, before):
        assert all(torch.equal(b, kept[n]) for n, b in m.algorithm.named_buffers())
    assert_each_equals_its_run_alone(requests)


def test_kept_adam_state_and_other_learning_rates_are_per_run():
    adam = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
    modules = [digits_module(s, FedAvg(1), client_optimizer=adam, keep_client_optimizer_state=True) for s in (0, 1)]
    modules.append(digits_module(2, FedAvg(1), lr=0.05))  # another client optimiser: another key, its own call
    executor = CohortExecutor()
    requests = requests_for(modules, round_idx=0, keys=["adam", "adam", "sgd lr 0.05"])
    executor.run(requests)
    assert executor.calls == 2
    for req in requests:
        alone = req.module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)
        for got, ref in zip(req.result, alone):
            for n in ref.state:
                assert_close_finite(got.state[n], ref.state[n], rtol=0, atol=1e-5, msg=n)
            for n in ref.upload:
                assert_close_finite(got.upload[n], ref.upload[n], rtol=0, atol=1e-5, msg=n)


class SeedDependent(FedAvg):
    """FedAvg whose number of local epochs is drawn from the run's seed (reads ``ctx.seed``)."""

    vectorizable = True

    def client_update(self, ctx, global_params, state):
        epochs = 1 + ctx.seed % 2
        params = ctx.sgd(self.client_model(global_params, state), ctx.param_names, epochs)
        return self.upload_shared(params, ctx, state, loss=ctx.train_loss)


def test_an_algorithm_that_reads_the_run_seed_gets_one_call_per_run():
    modules = [digits_module(s, SeedDependent()) for s in (0, 1)]
    executor = CohortExecutor()
    requests = requests_for(modules, round_idx=0)
    executor.run(requests)
    assert executor.calls == 2 and len(executor.per_run) == 1
    for req in requests:
        alone = req.module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)
        for got, ref in zip(req.result, alone):
            for n in ref.upload:
                assert_close_finite(got.upload[n], ref.upload[n], rtol=0, atol=1e-5, msg=n)


def test_runs_context_features_are_each_runs_own():
    """A frozen body's features in a cohort of two runs: each run's rows with its own body (one pass over the run's
    rows when its clients hold the run's global body, exactly as the run alone computes it), each client's own body
    when the rows are personal; against the body applied client by client."""
    g = torch.Generator().manual_seed(0)
    net = DigitsMLP(hidden=(8, 5))
    slices, sizes = [(0, 2), (2, 5)], [23, 9, 31, 5, 12]
    xs = [torch.rand(n, 64, generator=g) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    gens = [make_generator(3, "train", 0, k) for k in range(5)]
    runs = RunsContext(net, range(5), xs, ys, None, ClientOptimizer(batch_size=4), per_sample_loss_for(10), gens,
                       None, 0, 3, [1.0] * 5, rounds=[0] * 5, seeds=[3, 3, 4, 4, 4], run_slices=slices)  # fmt: skip
    globs = [{n: torch.randn(p.shape, generator=g) for n, p in net.named_parameters()} for _ in slices]
    cohort = {  # as run_stacked builds it: each run's global model, expanded over its clients
        n: torch.cat([gl[n].expand(hi - lo, *gl[n].shape) for gl, (lo, hi) in zip(globs, slices)]) for n in globs[0]
    }
    runs.run_global = cohort
    personal = {n: v + 0.1 * torch.randn(v.shape, generator=g) for n, v in cohort.items()}

    def body_of(params: dict, k: int) -> dict:
        return {n[len("body.") :]: v[k] for n, v in params.items() if n.startswith("body.")}

    for params, shared in ((cohort, True), (personal, False)):
        body, _ = runs._body_of({n: v.detach() for n, v in params.items()})
        assert all(runs._run_body(body, lo, hi)[1] == shared for lo, hi in slices)
        feats = runs._features({n: v.detach() for n, v in params.items()})
        ref = torch.cat([functional_call(net.body, body_of(params, k), (x,)) for k, x in enumerate(xs)])
        assert_close_finite(feats, ref, rtol=1e-6, atol=1e-6)
        x = torch.rand(5, 8, 64, generator=g)  # a block of augmented batches: [K, M, ...]
        passed = runs._body_pass(body, False, x)
        ref = torch.stack([functional_call(net.body, body_of(params, k), (x[k],)) for k in range(5)])
        assert_close_finite(passed, ref, rtol=1e-6, atol=1e-6)
    alone = []  # each run alone, its clients holding its global model (stride 0, as the engine passes it)
    for gl, (lo, hi) in zip(globs, slices):
        ctx = VectorizedContext(net, range(hi - lo), xs[lo:hi], ys[lo:hi], None, ClientOptimizer(batch_size=4),
                                per_sample_loss_for(10), gens[lo:hi], None, 0, 3, [1.0] * (hi - lo))  # fmt: skip
        alone.append(ctx._features({n: v.expand(hi - lo, *v.shape) for n, v in gl.items()}))
    assert torch.equal(runs._features(cohort), torch.cat(alone))
