"""The vectorized (stacked) executor gives the sequential loop's results: updates, metrics, personal state, for the
methods and configs that run stacked."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch

from datamodules import DigitsDataModule, Dirichlet, Shards
from datamodules.augment import CropFlip
from fl_lightning.algorithms import (
    APFL,
    L2GD,
    SCAFFOLD,
    Ditto,
    FedAvg,
    FedMTL,
    FedPer,
    FedProx,
    FedRep,
    LGFedAvg,
    LocalOnly,
    PerFedAvg,
)
from fl_lightning.cli import train_config
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import loss_fn_for
from fl_lightning.engine.stacked import VectorizedContext, per_sample_loss_for, stack, stacked_forward, unstack
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.heavy_ball_mlp import METHODS
from tests.helpers.round_references import DIGITS
from tests.helpers.training import fit

# ---- every method on digits, both executors, with held-out new clients -------------------------------------------
NEW_CLIENTS = [
    "--data", "tests.helpers.digits_runs.DigitsWithNewClients", "--data.init_args.num_clients", "10",
    "--data.init_args.participation", "0.3", "--data.init_args.partition", "datamodules.Shards",
]  # fmt: skip


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """Each method's digits config for 3 rounds in each executor (short fine-tuning), with the fallback logs."""
    out = {}
    for method in METHODS:
        for executor in ("sequential", "vectorized"):
            handler = _Capture()
            logging.getLogger("fl_lightning").addHandler(handler)
            try:
                summary = train_config(
                    ["configs/digits/base.yaml", f"configs/digits/{method}.yaml"],
                    [
                        *NEW_CLIENTS, "--trainer.max_steps", "3", "--model.eval_last", "1",
                        "--model.executor", executor, "--model.new_client_finetune.epochs", "1",
                        "--trainer.logger", "false",
                        *(["--model.finetune.epochs", "1"] if method == "fedbabu" else []),
                    ],
                    run_dir=tmp_path_factory.mktemp(f"{method}_{executor}"),
                )  # fmt: skip
            finally:
                logging.getLogger("fl_lightning").removeHandler(handler)
            out[method, executor] = summary, handler.lines
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow  # its module fixture trains every method twice: setup time that mutmut's timing cannot see
@pytest.mark.parametrize("method", METHODS)
def test_each_method_runs_on_digits_in_both_executors_with_new_clients(method, digits_runs):
    seq, _ = digits_runs[method, "sequential"]
    vec, logs = digits_runs[method, "vectorized"]
    for summary in (seq, vec):
        assert summary["rounds"] == 3 and 0.0 <= summary["final"] <= 1.0
        assert 0.0 <= summary["new_clients_acc"] <= 1.0  # held-out clients fine-tuned and evaluated
    assert vec["final"] == pytest.approx(seq["final"], abs=1e-6)
    assert vec["new_clients_acc"] == pytest.approx(seq["new_clients_acc"], abs=1e-6)
    fallback = [line for line in logs if "falls back to 'sequential'" in line]
    expected = {"fedala": "FedALA is not marked vectorizable"}  # FedBN (per-client BN statistics), FedRoD: stacked
    if method in expected:
        assert len(fallback) == 1 and expected[method] in fallback[0]
    else:
        assert not fallback  # FedBABU runs on the vectorized executor itself


CHEAP = {"pfedme": ["--model.algorithm.init_args.local_steps", "3"]}


@pytest.mark.parametrize("method", ["pfedme", "fedproto", "moon", "feddyn"])
def test_digits_config_runs_in_both_executors_with_the_same_result(method, tmp_path, caplog):
    overrides = [*CHEAP.get(method, []), "--trainer.max_steps", "2", "--model.eval_every", "100"]
    overrides += ["--model.eval_last", "1"]
    configs = [*DIGITS, f"configs/digits/{method}.yaml"]
    seq = train_config(configs, overrides, run_dir=tmp_path / "seq")
    vec = train_config(configs, [*overrides, "--model.executor", "vectorized"], run_dir=tmp_path / "vec")
    assert seq["rounds"] == vec["rounds"] == 2 and 0.0 <= seq["final"] <= 1.0
    assert seq["final"] == vec["final"] and seq["algorithm"] == vec["algorithm"]
    assert "falls back to 'sequential'" not in caplog.text  # all four run stacked (the client contract)


ALGORITHMS = {
    "fedavg": lambda: FedAvg(2),
    "fedrep": lambda: FedRep(3, 1),
    "fedper": lambda: FedPer(1),
    "lg_fedavg": lambda: LGFedAvg(1, personal=("body.fc1",)),
    "local": lambda: LocalOnly(2),
    # the Table-1 baselines made vectorizable (issue 16): penalties with per-client data, custom step directions
    "fedprox": lambda: FedProx(mu=0.3, local_epochs=2, personal=("head.",)),
    "ditto": lambda: Ditto(lam=0.5, local_epochs=1, personal_epochs=2),
    "scaffold": lambda: SCAFFOLD(local_epochs=2),
    "apfl": lambda: APFL(alpha=0.3, local_epochs=2),
    "l2gd_local": lambda: L2GD(local_epochs=2),
    "l2gd_aggregate": lambda: L2GD(local_epochs=2),
    "fedmtl": lambda: FedMTL(local_epochs=2, reg_scale=0.05),
    "perfedavg": lambda: PerFedAvg(inner_lr=0.05, local_epochs=2),
    "perfedavg_fo": lambda: PerFedAvg(inner_lr=0.05, local_epochs=1, first_order=True),
}


#: network variants: the MLP steps with batched matrix products; the CNN client by client (the CPU's choice) or
#: vmap-ed over per-client conv weights (the accelerators' choice, checked here on the CPU)
NETWORKS = {"mlp": (DigitsMLP, None), "cnn_loop": (DigitsCNN, True), "cnn_vmap": (DigitsCNN, False)}


def contexts(net, sizes, budgets=None, batch_size=7, augment=None, loop=None, round_idx=0):
    """One VectorizedContext and the matching ClientContexts over clients of unequal sizes."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 8, 8, generator=g) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    budgets = budgets or [1.0] * len(sizes)
    opt = ClientOptimizer(lr=0.05, momentum=0.5, weight_decay=1e-3, batch_size=batch_size, decay_bias=False)
    gens = [make_generator(5, "train", round_idx, k) for k in range(len(sizes))]
    vctx = VectorizedContext(
        net, range(len(sizes)), xs, ys, None, opt, per_sample_loss_for(10), gens, augment, round_idx, 5, budgets,
        loop_over_clients=loop,
    )  # fmt: skip
    seq = [
        client_context(
            net, xs[k], ys[k], client=k, optimizer=opt, loss=loss_fn_for(10),
            generator=make_generator(5, "train", round_idx, k), augment=augment, round_idx=round_idx, seed=5,
            step_budget=b,
        )
        for k, b in enumerate(budgets)
    ]
    return vctx, seq


def prepared(name: str, glob: dict) -> tuple:
    """The algorithm with its server state set up (10 clients), and the round its contexts run in."""
    algorithm = ALGORITHMS[name]()
    algorithm.setup(glob, 10)
    if name == "scaffold":  # a non-zero server control variate
        g = torch.Generator().manual_seed(3)
        for c in algorithm.server_variate().values():
            c.copy_(0.01 * torch.randn(c.shape, generator=g))
    round_idx = 0
    if name.startswith("l2gd"):  # a round whose coin is a local (or an aggregation) step
        wanted = name == "l2gd_aggregate"
        round_idx = next(r for r in range(100) if algorithm.aggregation_round(5, r) == wanted)
    return algorithm, round_idx


def check_client_updates(name, network, augment=None):
    torch.manual_seed(0)
    make_net, loop = NETWORKS[network]
    net = make_net()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algorithm, round_idx = prepared(name, glob)
    template = algorithm.init_client_state(glob)
    states = [{n: v + 0.01 * (k + 1) for n, v in template.items()} for k in range(4)]
    vctx, seq = contexts(
        net, [23, 9, 31, 14], budgets=[1.0, 1.0, 0.5, 1.0], augment=augment, loop=loop, round_idx=round_idx
    )
    expanded = {n: v.expand(4, *v.shape) for n, v in glob.items()}
    batched = algorithm.client_update(vctx, expanded, stack(states) if template else {})
    for k in range(4):
        ref = algorithm.client_update(seq[k], glob, states[k])
        assert int(batched.num_samples[k]) == ref.num_samples
        assert abs(float(batched.loss[k]) - float(ref.loss)) < 1e-5
        for part, expected in (("upload", ref.upload), ("state", ref.state)):
            got = unstack(getattr(batched, part), k)
            assert set(got) == set(expected)
            for n in expected:
                assert_close_finite(got[n], expected[n], rtol=1e-5, atol=1e-5, msg=f"{part} {n} client {k}")
    return vctx


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("network", list(NETWORKS))
def test_vectorized_client_updates_equal_sequential(name, network):
    """Every vectorizable algorithm, three ways of computing a step, unequal clients, a straggler: the sequential
    loop's uploads, states and losses to 1e-5."""
    assert type(ALGORITHMS[name]()).__dict__.get("vectorizable") is True
    check_client_updates(name, network)


@pytest.mark.parametrize("name", ["fedrep", "fedavg", "ditto", "scaffold", "apfl", "perfedavg"])
@pytest.mark.parametrize("network", ["mlp", "cnn_vmap", "cnn_loop"])
def test_vectorized_client_updates_equal_sequential_with_crop_and_flip(name, network):
    """Augmentation drawn a phase ahead (one copy) gives the sequential loop's batches: the same numbers."""
    vctx = check_client_updates(name, network, augment=CropFlip(1))
    if name == "fedrep":  # the head phase ran the frozen shared body on the augmented batches in a few passes
        assert 0 < vctx.feature_passes < 10


def test_feature_caching_computes_the_frozen_body_once_and_matches_recomputing():
    torch.manual_seed(0)
    net = DigitsMLP()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    heads = [{n: v for n, v in glob.items() if n.startswith("head.")} for _ in range(3)]
    cached, _ = contexts(net, [12, 20, 5])
    recomputed, _ = contexts(net, [12, 20, 5])
    recomputed.cache_features = False
    expanded = {n: v.expand(3, *v.shape) for n, v in glob.items()}
    names = [n for n in glob if n.startswith("head.")]
    a = cached.sgd({**expanded, **stack(heads)}, names, epochs=10)
    b = recomputed.sgd({**expanded, **stack(heads)}, names, epochs=10)
    assert cached.feature_passes == 1 and recomputed.feature_passes == 0
    for n in names:
        assert_close_finite(a[n], b[n], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fedavg", "fedrep", "lg_fedavg"])
def test_several_rounds_give_the_same_metrics_and_personal_state(name):
    def run(executor):
        L.seed_everything(0, verbose=False)
        module = FederatedModule(ALGORITHMS[name](), DigitsMLP(), eval_every=1, executor=executor)
        dm = DigitsDataModule(num_clients=10, partition=Dirichlet(0.5), clients_per_round=4, seed=0)
        return fit(module, dm, rounds=4)

    seq, vec = run("sequential"), run("vectorized")
    for a, b in zip(seq.history, vec.history):
        for key in a:
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    for n, p in seq.net.named_parameters():
        assert_close_finite(dict(vec.net.named_parameters())[n], p, rtol=1e-5, atol=1e-5)
    for n in seq.bank.names:
        assert_close_finite(vec.bank.row(n), seq.bank.row(n), rtol=1e-5, atol=1e-5)


def test_unsupported_algorithm_falls_back_to_sequential(caplog):
    class Custom(FedAvg):  # a subclass must declare vectorizable itself
        pass

    module = FederatedModule(Custom(1), DigitsMLP(), eval_every=100, executor="vectorized")
    fit(module, DigitsDataModule(num_clients=4, partition=Shards(5), clients_per_round=2, seed=0), rounds=2)
    assert caplog.text.count("falls back to 'sequential'") == 1


def test_finetune_evaluation_is_the_same_on_both_paths():
    from fl_lightning.engine.module import FineTune

    def run(executor):
        L.seed_everything(0, verbose=False)
        module = FederatedModule(FedAvg(1), DigitsMLP(), eval_every=100, finetune=FineTune(5), executor=executor)
        fit(module, DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0), rounds=2)
        return module.summary

    seq, vec = run("sequential"), run("vectorized")
    assert abs(seq["final_ft"] - vec["final_ft"]) < 1e-6 and abs(seq["final"] - vec["final"]) < 1e-6
    assert seq["final_ft"] != seq["final"]  # one training run carries both the plain and the "+FT" result


def test_fast_evaluation_computes_body_features_once_not_per_client(monkeypatch):
    """The MLP body (stackable) passes all test rows once, as one batched product per layer
    (``stacked_forward`` with one stacked copy); the sequential path runs the body once per client."""
    from fl_lightning.engine import evaluation

    calls = {"n": 0}
    module = FederatedModule(FedRep(1, 1), DigitsMLP(), eval_every=100, executor="vectorized")
    fit(module, DigitsDataModule(num_clients=20, partition=Shards(2), clients_per_round=4, seed=0), rounds=1)
    module.net.body.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
    body_passes = []

    def counted(mod, params, x, prefix=""):
        if mod is module.net.body:
            body_passes.append(x.shape[:2])
        return stacked_forward(mod, params, x, prefix)

    monkeypatch.setattr(evaluation, "stacked_forward", counted)
    fast = module.evaluate_clients(0)
    test_rows = module.fed.test.x.shape[0]
    assert body_passes == [(1, test_rows)] and calls["n"] == 0
    calls["n"] = 0
    module.executor = "sequential"
    slow = module.evaluate_clients(0)
    assert calls["n"] == 20
    assert_close_finite(fast["acc_per_client"], slow["acc_per_client"])
    assert_close_finite(fast["loss_per_client"], slow["loss_per_client"], rtol=1e-5, atol=1e-6)


def test_new_clients_fine_tune_a_fresh_head_and_both_paths_agree():
    class WithNewClients(DigitsDataModule):
        def setup(self, stage=None):
            super().setup(stage)
            other = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
            other.setup()
            self.new_clients = other.federated

    def run(executor):
        L.seed_everything(0, verbose=False)
        module = FederatedModule(FedRep(2, 1), DigitsMLP(), eval_every=100, executor=executor)
        dm = WithNewClients(num_clients=10, partition=Shards(2), clients_per_round=5, seed=0)
        fit(module, dm, rounds=3)
        return module

    seq, vec = run("sequential"), run("vectorized")
    assert 0.0 <= seq.summary["new_clients_acc"] <= 1.0
    assert abs(seq.summary["new_clients_acc"] - vec.summary["new_clients_acc"]) < 1e-6
    assert seq.bank.num_clients == 10  # the training clients' bank is untouched by new clients


@pytest.mark.parametrize("name", ["fedavg", "fedrep"])
def test_lstm_falls_back_to_clients_in_turn_logged_once_with_the_same_results(name, caplog, monkeypatch):
    """Sent140's LSTM has no batching rule for per-client weights: its phases run client by client (one warning);
    FedRep's head phase still computes the frozen shared LSTM body's features in one pass."""
    from fl_lightning.models import Sent140LSTM

    torch.manual_seed(0)
    net = Sent140LSTM(vocab_size=50, embed_dim=8, hidden=8, fc=4)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algorithm = ALGORITHMS[name]()
    template = algorithm.init_client_state(glob)
    states = [{n: v + 0.01 * k for n, v in template.items()} for k in range(3)]
    g = torch.Generator().manual_seed(0)
    sizes = [13, 7, 20]
    xs = [torch.randint(1, 50, (n, 5), generator=g) for n in sizes]
    ys = [torch.randint(0, 2, (n,), generator=g) for n in sizes]
    opt = ClientOptimizer(lr=0.05, momentum=0.5, batch_size=4)
    vctx = VectorizedContext(
        net, range(3), xs, ys, None, opt, per_sample_loss_for(2), [make_generator(1, k) for k in range(3)], None, 0,
        1, [1.0] * 3,
    )  # fmt: skip
    expanded = {n: v.expand(3, *v.shape) for n, v in glob.items()}
    with caplog.at_level("WARNING", logger="fl_lightning"):
        batched = algorithm.client_update(vctx, expanded, stack(states) if template else {})
        algorithm.client_update(vctx, expanded, stack(states) if template else {})
    assert caplog.text.count("recurrent layers (LSTM) have no batched form") == 1
    assert vctx.feature_passes == (2 if name == "fedrep" else 0)  # one per round's head phase
    for k in range(3):
        seq = client_context(
            net, xs[k], ys[k], client=k, optimizer=opt, loss=loss_fn_for(2), generator=make_generator(1, k),
        )
        ref = algorithm.client_update(seq, glob, states[k])
        for n in ref.upload:
            assert_close_finite(batched.upload[n][k], ref.upload[n], rtol=1e-5, atol=1e-5, msg=n)
