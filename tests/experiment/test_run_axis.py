"""The run axis: runs batched in one job give exactly what each gives alone, and write what train.py writes."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import SCAFFOLD, FedAvg, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.algorithms.base import Algorithm
from fl_lightning.cli import train_config
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler, make_generator
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import per_sample_loss_for, stackable, stacked_forward
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.run_axis import BatchedRuns, check_batchable, parse_config
from fl_lightning.experiment.run_axis.__main__ import main as run_axis_main
from fl_lightning.experiment.run_axis.__main__ import seed_runs
from fl_lightning.experiment.run_axis.cohorts import CohortExecutor, CohortRequest, RunsContext
from fl_lightning.experiment.run_axis.shared_data import RowPool, SharedRowsSplit
from fl_lightning.models import DigitsMLP
from tests.helpers.asserts import assert_close_finite

ROOT = Path(__file__).resolve().parents[2]


QUICK = [
    "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_steps", "4", "--checkpoint_every", "2",
    "--model.algorithm.init_args.head_epochs", "2", "--trainer.enable_progress_bar", "false",
]  # fmt: skip


class CrashAt(Callback):
    """Raises at the start of round ``round`` (a crash after the checkpoint of the rounds before)."""

    def __init__(self, round: int) -> None:
        self.round = round

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.round:
            raise RuntimeError(f"crash at round {self.round}")


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_same_run(batched: Path, solo: Path) -> None:
    """Same evaluation history (every metric of every evaluated round) and same final parameters and bank."""
    hb, hs = json.loads((batched / "history.json").read_text()), json.loads((solo / "history.json").read_text())
    assert [h["round"] for h in hb] == [h["round"] for h in hs] and len(hs) >= 3
    for key in ("val/acc_mean", "val/acc_weighted", "val/loss"):
        assert_close_finite([h[key] for h in hb], [h[key] for h in hs], rtol=0, atol=1e-5, msg=key)
    sb, ss = final_state(batched), final_state(solo)
    assert set(sb) == set(ss)
    for name in ss:
        if ss[name].is_floating_point():
            assert_close_finite(sb[name], ss[name], rtol=0, atol=1e-5, msg=name)
    sum_b, sum_s = json.loads((batched / "summary.json").read_text()), json.loads((solo / "summary.json").read_text())
    assert sum_b["rounds"] == sum_s["rounds"] == 4
    assert abs(sum_b["final"] - sum_s["final"]) < 1e-5 and abs(sum_b["last10"] - sum_s["last10"]) < 1e-5


def test_three_seeds_batched_equal_three_solo_runs_and_write_their_own_run_dirs(tmp_path):
    seeds = [0, 1, 2]
    job = BatchedRuns(seed_runs([*QUICK, "--run_dir", str(tmp_path / "batched")], seeds))
    outcomes = job.run()
    assert [o.status for o in outcomes] == ["done"] * 3, [o.error for o in outcomes]
    assert job.lockstep.executor.calls == 4  # one stacked call per round for the three runs
    partitions = {tuple(m.fed.train.sizes.tolist()) for m in job.modules}
    assert len(partitions) == 3  # each seed has its own partition
    assert len({id(m.fed.train.pool) for m in job.modules}) == 1  # ... of one pooled copy of the rows
    for s in seeds:
        solo = tmp_path / "solo" / f"s{s}"
        train_config([QUICK[1]], [*QUICK[2:], "--seed_everything", str(s)], run_dir=solo)  # sequential executor
        batched = tmp_path / "batched" / f"s{s}"
        for name in ("metrics.csv", "summary.json", "config.yaml", "history.json", "checkpoints/last.ckpt"):
            assert (batched / name).is_file(), name
        assert "seed_everything: " + str(s) in (batched / "config.yaml").read_text()
        assert_same_run(batched, solo)
        rows = (batched / "metrics.csv").read_text().splitlines()
        assert len(rows) == len((solo / "metrics.csv").read_text().splitlines())


@pytest.mark.slow
def test_scaffold_seeds_batched_equal_their_solo_runs_server_variates_included(tmp_path):
    """SCAFFOLD's runs each update their own c (``server_update``) and train in one stacked call per round."""
    scaffold = [
        "--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/scaffold.yaml"),
        "--trainer.max_steps", "4", "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    job = BatchedRuns(seed_runs([*scaffold, "--run_dir", str(tmp_path / "batched")], [0, 1]))
    assert [o.status for o in job.run()] == ["done"] * 2
    assert job.lockstep.executor.calls == 4
    variates = []
    for s in (0, 1):
        solo = tmp_path / "solo" / f"s{s}"
        train_config([scaffold[1], scaffold[3]], [*scaffold[4:], "--seed_everything", str(s)], run_dir=solo)
        assert_same_run(tmp_path / "batched" / f"s{s}", solo)  # the checkpoint's state_dict holds c
        variates.append(final_state(solo)["algorithm.c__head__weight"])
    assert float(variates[0].abs().max()) > 0 and not torch.equal(variates[0], variates[1])


def test_a_batched_job_resumes_from_its_runs_checkpoints(tmp_path):
    """Runs that crash at different rounds resume together (each from its own last checkpoint) to the result of
    an uninterrupted run."""
    runs = seed_runs([*QUICK, "--checkpoint_every", "1", "--run_dir", str(tmp_path / "job")], [0, 1])
    crashing = [
        [*args, "--trainer.callbacks+=tests.experiment.test_run_axis.CrashAt", f"--trainer.callbacks.round={r}"]
        for args, r in zip(runs, (1, 3))
    ]
    logs = [tmp_path / "s0.log", tmp_path / "s1.log"]
    first = BatchedRuns(crashing, logs=logs).run()
    assert [o.status for o in first] == ["failed", "failed"] and "crash at round" in first[0].error
    texts = [log.read_text() for log in logs]  # each run's console output in its own log
    assert "crash at round 1" in texts[0] and "crash at round 3" not in texts[0]
    assert "crash at round 3" in texts[1] and "crash at round 1" not in texts[1]
    assert not (tmp_path / "job" / "s0" / "summary.json").exists()
    assert (tmp_path / "job" / "s1" / "checkpoints" / "round00003.ckpt").is_file()
    assert not (tmp_path / "job" / "s0" / "checkpoints" / "round00002.ckpt").exists()  # s0 resumes from round 1
    resumed = BatchedRuns([[*args, "--ckpt_path", "last"] for args in runs]).run()
    assert [o.status for o in resumed] == ["done", "done"], [o.error for o in resumed]
    for s in (0, 1):
        solo = tmp_path / "solo" / f"s{s}"
        train_config([QUICK[1]], [*QUICK[2:], "--seed_everything", str(s)], run_dir=solo)
        assert_same_run(tmp_path / "job" / f"s{s}", solo)


def test_configs_that_cannot_share_a_batch_are_refused_with_one_line(tmp_path, capsys):
    base = ["--config", str(ROOT / "configs/digits/base.yaml")]
    fedavg = [*base, "--config", str(ROOT / "configs/digits/fedavg.yaml")]
    fedrep = [*base, "--config", str(ROOT / "configs/digits/fedrep.yaml")]
    wide = [*fedavg, "--model.network.init_args.hidden=[256,64]"]
    configs = [parse_config(a) for a in (fedavg, fedrep, wide)]
    with pytest.raises(ConfigError, match=r"run 1 cannot share a batch with run 0: model.algorithm.class_path "
                                          r'"fl_lightning.algorithms.FedAvg" -> "fl_lightning.algorithms.FedRep" '
                                          r"\(and \d+ more\); a batched job's runs differ only in seed_everything"):
        check_batchable(configs[:2])
    with pytest.raises(ConfigError, match=r"cannot share a batch .*: model.network.hidden \[128, 64\] -> \[256, 64\];"):
        check_batchable([configs[0], configs[2]])
    with pytest.raises(ConfigError, match=r": model.lr 0.05 -> 0.01; "):  # a client learning rate: another job
        check_batchable([parse_config([*fedavg, "--model.lr", "0.05"]), configs[0]])
    with pytest.raises(ConfigError, match=r": model.drop_last false -> true; "):
        check_batchable([configs[0], parse_config([*fedavg, "--model.drop_last", "true"])])
    check_batchable([configs[0], parse_config([*fedavg, "--seed_everything", "3", "--trainer.max_steps", "7"])])
    ddp = parse_config([*fedavg, "--trainer.devices", "2", "--trainer.strategy", "ddp"])
    with pytest.raises(ConfigError, match="one process"):
        check_batchable([configs[0], ddp])
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([fedavg, fedrep]))
    assert run_axis_main(["--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run 1 cannot share a batch")
    assert run_axis_main([*fedavg, "--seeds", "0,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


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


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_stacked_cohorts_of_three_runs_equal_each_runs_sequential_clients(name):
    modules = [digits_module(s, ALGORITHMS[name]()) for s in (0, 1, 2)]
    requests = requests_for(modules, round_idx=1, budgets=[1.0, 0.4, 1.0])
    CohortExecutor().run(requests)
    for req in requests:
        assert req.done and req.error is None
        alone = req.module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)  # sequential
        for got, ref in zip(req.result, alone):
            assert got.num_samples == ref.num_samples
            assert abs(got.loss - ref.loss) < 1e-5
            assert set(got.upload) == set(ref.upload) and set(got.state) == set(ref.state)
            for n in ref.upload:
                assert_close_finite(got.upload[n], ref.upload[n], rtol=0, atol=1e-5, msg=n)
            for n in ref.state:
                assert_close_finite(got.state[n], ref.state[n], rtol=0, atol=1e-5, msg=n)


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
    for req in requests:
        assert req.done and req.error is None
        alone = req.module.run_clients(req.clients, req.round_idx, req.glob, req.states, req.budgets)
        for got, ref in zip(req.result, alone):
            assert set(got.upload) == set(ref.upload) and set(got.state) == set(ref.state)
            for n in ref.upload:
                assert_close_finite(got.upload[n], ref.upload[n], rtol=0, atol=1e-5, msg=n)
            for n in ref.state:
                assert_close_finite(got.state[n], ref.state[n], rtol=0, atol=1e-5, msg=n)


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


def test_runs_share_one_copy_of_the_rows_and_keep_their_own_partition():
    feds = []
    for seed in (0, 1):
        data = DigitsDataModule(num_clients=10, partition=Shards(2), seed=seed)
        data.setup()
        feds.append(data.federated)
    pool = RowPool()
    shared = [pool.share(f) for f in feds]
    assert pool.rows() <= 1797  # the digits' images, once (the two seeds split them differently)
    for fed, mine in zip(feds, shared):
        for split in ("train", "test"):
            a, b = getattr(fed, split), getattr(mine, split)
            assert isinstance(b, SharedRowsSplit) and torch.equal(a.x, b.x) and torch.equal(a.ptr, b.ptr)
            for c in (0, 4, 9):
                assert torch.equal(a.client(c)[0], b.client(c)[0]) and torch.equal(a.client(c)[1], b.client(c)[1])
    moved = [s.to("cpu") for s in shared]
    assert moved[0].train.pool.on("cpu").data_ptr() == moved[1].test.pool.on("cpu").data_ptr()


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU])
@pytest.mark.parametrize("task", ["classification", "regression"])
def test_stacked_mlp_gradients_equal_each_clients_own(act, task):
    """One batched forward of K clients' MLPs, autograd on the sum of their losses: client c's gradient is the one
    of its own loss alone (plain autograd, one client at a time)."""
    torch.manual_seed(0)
    out_dim = 4 if task == "classification" else 1
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), act(), nn.Linear(5, out_dim))
    if task == "regression":
        net.append(nn.Flatten(0))  # [B, 1] → [B]: one output per sample
    assert stackable(net)
    k, b = 3, 5
    params = {n: torch.randn(k, *p.shape) for n, p in net.named_parameters()}
    x = torch.randn(k, b, 2, 3)
    y = torch.randint(0, 4, (k, b)) if task == "classification" else torch.randn(k, b)
    mask = torch.ones(k, b)
    mask[1, 3:] = 0  # a short last batch
    loss = per_sample_loss_for(4 if task == "classification" else None)
    leaves = {n: v.clone().requires_grad_(True) for n, v in params.items()}
    out = stacked_forward(net, leaves, x)
    losses = (loss(out.flatten(0, 1), y.flatten(0, 1)).view(k, b) * mask).sum(1) / mask.sum(1)
    grads = dict(zip(leaves, torch.autograd.grad(losses.sum(), list(leaves.values()))))
    for c in range(k):  # the reference: client c alone, plain autograd
        own = {n: v[c].clone().requires_grad_(True) for n, v in params.items()}
        m = mask[c].bool()
        pred = functional_call(net, own, (x[c][m],))
        ref = F.cross_entropy(pred, y[c][m]) if task == "classification" else (0.5 * (pred - y[c][m]) ** 2).mean()
        ref_grads = torch.autograd.grad(ref, list(own.values()))
        assert_close_finite(losses[c], ref.detach(), rtol=1e-5, atol=1e-6)
        for n, g in zip(own, ref_grads):
            assert_close_finite(grads[n][c], g, rtol=1e-5, atol=1e-6, msg=n)


def test_runs_that_differ_only_in_naming_and_seed_are_parsed_once(monkeypatch):
    """A grid's seeds share one parse (building train.py's parser is a large part of a short batched job)."""
    from fl_lightning.experiment.run_axis import driver

    base = ["--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/fedavg.yaml")]
    seeds = [[*base, f"--seed_everything={s}", "--run_dir", f"/tmp/r/s{s}", f"--wandb.name=s{s}"] for s in range(3)]
    other = [*base, "--model.lr", "0.05", "--seed_everything", "4", "--run_dir=/tmp/r/lr"]
    parsed: list[list[str]] = []
    monkeypatch.setattr(driver, "parse_config", lambda a: parsed.append(list(a)) or parse_config(a))
    configs = driver.parse_configs([*seeds, other])
    assert parsed == [seeds[0], other]
    assert configs[0] is configs[1] is configs[2] and configs[3]["model"]["lr"] == 0.05
    assert configs[0]["model"] == parse_config(seeds[2])["model"]


def test_two_runs_of_one_job_never_write_one_run_dir(tmp_path, capsys):
    """``--seeds 0,0`` and a ``--runs`` file whose runs name one ``--run_dir`` are refused in one line before
    anything is written (issue 45: two threads once wrote one run dir)."""
    assert run_axis_main([*QUICK, "--run_dir", str(tmp_path / "job"), "--seeds", "0,1,0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --seeds 0,1,0: seed 0 is given twice (each seed is one run with its own run dir "
                   "<run_dir>/s<seed>); give each seed once"]  # fmt: skip
    runs = tmp_path / "runs.json"
    same = str(tmp_path / "one")
    runs.write_text(json.dumps([[*QUICK, "--run_dir", same], [*QUICK, "--seed_everything", "1", f"--run_dir={same}"]]))
    assert run_axis_main(["--runs", str(runs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run 1 and run 0 both write run_dir {same}: give each run its own --run_dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.json"]


def test_what_the_engine_says_inside_a_shared_step_is_in_every_runs_log(tmp_path):
    """Two seeds batched on the stacked path with a client optimiser that has no batched form (Adagrad): the stacked
    call says it falls back once, in the thread of the run that arrived last; each run's own log holds the line once,
    with its own executor and run-axis lines, and no logging error (issue 40)."""
    adagrad = ["--model.executor", "vectorized", "--model.client_optimizer", "torch.optim.Adagrad"]
    runs = seed_runs([*QUICK, *adagrad, "--trainer.max_steps", "2", "--run_dir", str(tmp_path / "job")], [0, 1])
    logs = [tmp_path / "s0.log", tmp_path / "s1.log"]
    outcomes = BatchedRuns(runs, ["s0", "s1"], logs=logs).run()
    assert [o.status for o in outcomes] == ["done", "done"], [o.error for o in outcomes]
    for log, name in zip(logs, ["s0", "s1"]):
        text = log.read_text()
        assert text.count("vectorized executor: client optimizer Adagrad has no batched form: clients run in turn") == 1
        assert text.count("executor: stacked (model.executor: vectorized)") == 1
        assert text.count(f"run axis: {name} is one of a batched job of 2 runs") == 1
        assert "Logging error" not in text
        ran = json.loads((tmp_path / "job" / name / "summary.json").read_text())["ran"]
        assert ran == {"executor": "stacked", "reason": "model.executor: vectorized",
                       "batch": {"runs": ["s0", "s1"], "stacked_with": ["s1" if name == "s0" else "s0"]}}  # fmt: skip


# ---- a refused job changes nothing, anywhere (issue 45) ------------------------------------------------------------


def tree(folder: Path) -> dict[str, str]:
    """Every file (its bytes' hash) and folder under ``folder``."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}  # fmt: skip


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory) -> Path:
    """A finished one-round batched job: ``<folder>/job/s0`` holds a finished run (W&B off)."""
    folder = tmp_path_factory.mktemp("finished_job")
    args = [*QUICK, "--trainer.max_steps", "1", "--wandb.mode", "disabled", "--run_dir", str(folder / "job")]
    assert run_axis_main([*args, "--seeds", "0"]) == 0
    assert (folder / "job" / "s0" / "summary.json").is_file()
    return folder / "job"


FEDAVG = ["--config", str(ROOT / "configs/digits/base.yaml"), "--config", str(ROOT / "configs/digits/fedavg.yaml")]
#: refusals of ``python -m fl_lightning.experiment.run_axis``: name -> (arguments, what the one line says). ``JOB`` is
#: the finished job's folder (``JOB/s0`` its finished run), ``NEW`` a folder no run wrote, ``RUNS:`` a ``--runs``
#: file with this JSON text.
AXIS_REFUSALS = {
    "unknown key": ([*QUICK, "--model.nope", "1", "--run_dir", "NEW", "--seeds", "0,1"], "unrecognized arguments"),
    "value of the wrong type": ([*QUICK, "--model.lr", "abc", "--run_dir", "NEW", "--seeds", "0,1"], "model.lr"),
    "out-of-range value": ([*QUICK, "--model.lr", "-1", "--run_dir", "NEW", "--seeds", "0,1"], "must be positive"),
    "missing config file": (["--config", "NEW/nope.yaml", "--seeds", "0"], "does not exist"),
    "seed given twice": ([*QUICK, "--run_dir", "NEW", "--seeds", "0,0"], "seed 0 is given twice"),
    "--runs file missing": (["--runs", "NEW/runs.json"], "no such file"),
    "--runs file not JSON": (["--runs", "RUNS:[[1,"], "not JSON"),
    "--runs file not a list of argument lists": (["--runs", 'RUNS:{"a": 1}'], "expected a JSON list"),
    "runs that cannot share a batch": (
        ["--runs", "RUNS:" + json.dumps([FEDAVG, [*FEDAVG, "--model.lr", "0.5"]])], "cannot share a batch"),
    "a run dir holding a finished run": ([*QUICK, "--run_dir", "JOB", "--seeds", "0,1"], "holds a finished run"),
    "a resume with another learning rate, in the finished run's dir": (
        [*QUICK, "--run_dir", "JOB", "--seeds", "0", "--ckpt_path", "last", "--model.lr", "0.05"],
        "was trained with other settings"),
    "GPU asked on a CPU": ([*QUICK, "--run_dir", "NEW", "--seeds", "0,1", "--trainer.accelerator", "gpu"],
                           "trainer.accelerator gpu"),
    "data that cannot be split": (
        [*QUICK, "--run_dir", "NEW", "--seeds", "0,1", "--data.init_args.num_clients", "200",
         "--data.init_args.partition.init_args.classes_per_client", "10"], "too few to fill"),
    "--overwrite of the finished run, GPU asked": (
        [*QUICK, "--run_dir", "JOB", "--seeds", "0", "--overwrite", "true", "--trainer.accelerator", "gpu"],
        "trainer.accelerator gpu"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(AXIS_REFUSALS))
def test_a_refused_job_leaves_every_file_tree_byte_identical(case, finished_job, tmp_path, capsys, monkeypatch):
    """Each refusal is one line and exit code 2, before any run writes: no run dir, no W&B run (offline, as a user
    without an account has it), nothing in the finished run's dir; the run dir checks (``check_run_dirs``) refuse
    the whole job before its first run starts, and a refusal that every run meets once its data or trainer is built
    (the runs share their config but for the seed) is said once."""
    if "GPU" in case and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    args, expected = AXIS_REFUSALS[case]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    given = []
    for a in args:
        if a.startswith("RUNS:"):
            (tmp_path / "runs.json").write_text(a[len("RUNS:"):])
            a = str(tmp_path / "runs.json")
        given.append(a.replace("NEW", str(tmp_path / "new")).replace("JOB", str(finished_job)))
    before = (tree(tmp_path), tree(finished_job.parent))
    code = run_axis_main(given)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (code, err)
    assert "[failed]" not in out and "Traceback" not in out + err
    assert (tree(tmp_path), tree(finished_job.parent)) == before
