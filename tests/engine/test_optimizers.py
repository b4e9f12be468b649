"""Client optimisers, learning-rate schedules over rounds, and the adaptive server optimisers.

References are written here independently: Reddi et al.'s Algorithm 2 in numpy, Adam in plain torch.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.func import functional_call
from torch.nn import functional as F

from datamodules import DigitsDataModule, Dirichlet, Shards
from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.cli import train_config
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.executor import client_settings
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import loss_fn_for, state_template
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import per_sample_loss_for, stack, unstack
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.server_optimizers import FedAdagrad, FedAdam, FedYogi
from tests.helpers.clients import client_context
from tests.helpers.training import fit, make_trainer

ROOT = Path(__file__).resolve().parents[2]


SERVER = {"adam": FedAdam, "yogi": FedYogi, "adagrad": FedAdagrad}


# ---- Algorithm 2 (Reddi et al., ICLR 2021), written independently in numpy -------------------------------------
def algorithm2(x0, deltas, variant, lr, beta1, beta2, tau):
    """Yields x_{t+1} for each pseudo-gradient round: m, v from m₋₁ = 0, v₋₁ = τ²; no bias correction."""
    x, m, v = x0.astype(np.float64), np.zeros_like(x0, np.float64), np.full_like(x0, tau**2, np.float64)
    signs = set()
    for delta in deltas:
        delta = np.asarray(delta, np.float64)
        m = beta1 * m + (1 - beta1) * delta
        if variant == "adagrad":
            v = v + delta**2
        elif variant == "yogi":
            signs |= set(np.sign(v - delta**2).ravel().tolist())
            v = v - (1 - beta2) * delta**2 * np.sign(v - delta**2)
        else:
            v = beta2 * v + (1 - beta2) * delta**2
        x = x + lr * m / (np.sqrt(v) + tau)
        yield x, signs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", list(SERVER))
def test_server_optimizer_matches_numpy_algorithm_2_over_six_rounds(variant, dtype):
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(4, 5))
    scales = [1e-2, 3e-2, 1e-4, 1e-5, 2e-2, 1e-6]  # large and tiny Δ², so Yogi's sign(v − Δ²) takes both signs
    deltas = [s * rng.normal(size=x0.shape) for s in scales]
    p = torch.nn.Parameter(torch.tensor(x0, dtype=dtype))
    opt = SERVER[variant]([p], lr=0.1, betas=(0.9, 0.99), tau=1e-3)
    reference = algorithm2(x0, deltas, variant, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    signs: set[float] = set()
    for delta, (expected, signs) in zip(deltas, reference):  # noqa: B007 (signs: after the loop)
        p.grad = -torch.tensor(delta, dtype=dtype)  # the engine's pseudo-gradient is −Δ
        opt.step()
        assert np.abs(p.detach().double().numpy() - expected).max() < 1e-6
    if variant == "yogi":
        assert signs == {-1.0, 1.0}
    if dtype == torch.float64:
        assert np.abs(p.detach().numpy() - expected).max() < 1e-12


def test_algorithm_2_is_not_torch_adam():
    """torch.optim.Adam bias-corrects and starts v at 0, so it is not FedAdam (why server_optimizers exists)."""
    x0, delta = np.ones(3), np.array([0.1, -0.2, 0.3])
    ours = torch.nn.Parameter(torch.tensor(x0))
    theirs = torch.nn.Parameter(torch.tensor(x0))
    a, b = FedAdam([ours], lr=0.1, tau=1e-3), torch.optim.Adam([theirs], lr=0.1, betas=(0.9, 0.99), eps=1e-3)
    for p, opt in ((ours, a), (theirs, b)):
        p.grad = -torch.tensor(delta)
        opt.step()
    expected, _ = next(algorithm2(x0, [delta], "adam", 0.1, 0.9, 0.99, 1e-3))
    assert np.abs(ours.detach().numpy() - expected).max() < 1e-12
    assert np.abs(theirs.detach().numpy() - expected).max() > 1e-3


@pytest.mark.parametrize("variant", list(SERVER))
def test_server_optimizer_end_to_end_matches_numpy_over_five_rounds(variant):
    """One client, full-batch GD (momentum 0) as the local update, the adaptive server step on its delta."""
    rounds, client_lr, epochs = 5, 0.1, 2
    L.seed_everything(0, verbose=False)
    net = DigitsMLP()
    x0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    dm = DigitsDataModule(num_clients=1, partition=Shards(10), clients_per_round=1, seed=0)
    server = functools.partial(SERVER[variant], lr=0.05, betas=(0.9, 0.99), tau=1e-3)
    module = FederatedModule(
        FedAvg(epochs), net, lr=client_lr, momentum=0.0, batch_size=10_000, eval_every=100, server_optimizer=server
    )
    fit(module, dm, rounds=rounds)

    x, y = dm.federated.train.client(0)
    reference, deltas, glob = DigitsMLP(), {n: [] for n in x0}, dict(x0)
    steps = {n: algorithm2(v.numpy(), (d for d in deltas[n]), variant, 0.05, 0.9, 0.99, 1e-3) for n, v in x0.items()}
    for _ in range(rounds):
        local = {n: v.clone() for n, v in glob.items()}
        for _ in range(epochs):  # plain gradient descent on the full batch
            leaves = {n: v.requires_grad_(True) for n, v in local.items()}
            loss = F.cross_entropy(functional_call(reference, leaves, (x,)), y)
            grads = torch.autograd.grad(loss, list(leaves.values()))
            local = {n: (v - client_lr * g).detach() for (n, v), g in zip(leaves.items(), grads)}
        for n in glob:
            deltas[n].append((local[n] - glob[n]).double().numpy())
        glob = {n: torch.tensor(next(steps[n])[0], dtype=torch.float32) for n in glob}
    for n, p in module.net.named_parameters():
        assert (p.detach() - glob[n]).abs().max() < 1e-6, n


# ---- client optimisers ------------------------------------------------------------------------------------------
def contexts(net, sizes, optimizer, budgets=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(n, 1, 8, 8, generator=g, dtype=dtype) for n in sizes]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in sizes]
    budgets = budgets or [1.0] * len(sizes)
    gens = [make_generator(5, "train", 0, k) for k in range(len(sizes))]
    vctx = VectorizedContext(
        net, range(len(sizes)), xs, ys, None, optimizer, per_sample_loss_for(10), gens, None, 0, 5, budgets
    )
    seq = [
        client_context(
            net, xs[k], ys[k], client=k, optimizer=optimizer, loss=loss_fn_for(10),
            generator=make_generator(5, "train", 0, k), seed=5, step_budget=b,
        )
        for k, b in enumerate(budgets)
    ]
    return vctx, seq, xs, ys


def adam_reference(net, params, x, y, steps, lr, betas, eps, wd, decoupled, amsgrad):
    """Adam (Kingma & Ba, with PyTorch's eps placement) on the full batch, in plain torch."""
    b1, b2 = betas
    p = {n: v.clone() for n, v in params.items()}
    m = {n: torch.zeros_like(v) for n, v in p.items()}
    v2 = {n: torch.zeros_like(v) for n, v in p.items()}
    vmax = {n: torch.zeros_like(v) for n, v in p.items()}
    for t in range(1, steps + 1):
        leaves = {n: v.requires_grad_(True) for n, v in p.items()}
        grads = torch.autograd.grad(F.cross_entropy(functional_call(net, leaves, (x,)), y), list(leaves.values()))
        new = {}
        for (n, w), g in zip(leaves.items(), grads):
            w = w.detach()
            if decoupled:
                w = w * (1 - lr * wd)
            else:
                g = g + wd * w
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            vmax[n] = torch.maximum(vmax[n], v2[n])
            second = vmax[n] if amsgrad else v2[n]
            new[n] = w - lr / (1 - b1**t) * m[n] / (second.sqrt() / (1 - b2**t) ** 0.5 + eps)
        p = new
    return p, m, v2


ADAM_VARIANTS = {
    "adam": (torch.optim.Adam, dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), False, False),
    "adam_l2": (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01), False, False),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1), True, False),
    "amsgrad": (
        torch.optim.Adam,
        dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, amsgrad=True),
        False,
        True,
    ),
}


@pytest.mark.parametrize("variant", list(ADAM_VARIANTS))
def test_client_adam_matches_a_plain_torch_reference_in_both_executors(variant):
    """In float64: Adam divides by √v, which magnifies the float32 rounding of near-zero gradients (the full batch
    is summed in shuffled order) to ~1e-6; in float64 the paths agree to 1e-9."""
    cls, hyper, decoupled, amsgrad = ADAM_VARIANTS[variant]
    torch.manual_seed(0)
    net = DigitsMLP().double()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    sizes = [23, 9, 31]
    optimizer = ClientOptimizer.from_config(functools.partial(cls, **hyper), batch_size=max(sizes))  # full batch
    vctx, seq, xs, ys = contexts(net, sizes, optimizer, dtype=torch.float64)
    names = list(glob)
    batched = vctx.sgd({n: v.expand(3, *v.shape) for n, v in glob.items()}, names, epochs=4)
    for k in range(3):
        sequential = seq[k].sgd(glob, names, epochs=4)
        extra = {key: hyper[key] for key in ("lr", "betas", "eps")}
        expected, _, _ = adam_reference(
            net, glob, xs[k], ys[k], 4, wd=hyper["weight_decay"], decoupled=decoupled, amsgrad=amsgrad, **extra
        )
        for n in names:
            assert (sequential[n] - expected[n]).abs().max() < 1e-9, ("sequential", n, k)
            assert (batched[n][k] - expected[n]).abs().max() < 1e-9, ("vectorized", n, k)


CLIENT_OPTIMIZERS = {
    "adam": functools.partial(torch.optim.Adam, lr=0.01, weight_decay=1e-3),
    "adamw_amsgrad": functools.partial(torch.optim.AdamW, lr=0.01, amsgrad=True),
    "sgd_nesterov": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd_dampening": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, dampening=0.3),
    "rmsprop_unbatched": functools.partial(torch.optim.RMSprop, lr=0.01),
    # the CNN's convolutions run in channels_last on the stacked path: their float32 rounding differs from the loop's
    # by ~1e-9, and Adam turns an element whose gradient is that small (a unit dead on a client's batches) into a
    # step of up to lr·g/(|g| + eps); eps 1e-6 keeps such an element's step below the comparison's 1e-5 (with the
    # default 1e-8 one weight of one client differed by 3.5e-5 on this machine's torch 2.14 CPU kernels)
    "adam_cnn": functools.partial(torch.optim.Adam, lr=0.01, weight_decay=1e-3, eps=1e-6),
}


@pytest.mark.parametrize(
    ("name", "network"),
    [(name, DigitsMLP) for name in CLIENT_OPTIMIZERS if name != "adam_cnn"] + [("adam_cnn", DigitsCNN)],
)  # conv phases run client by client in the vectorized executor: one optimiser is enough there
def test_vectorized_client_optimizers_equal_sequential_with_minibatches_and_kept_state(name, network):
    """Unequal clients, minibatches of 7, a straggler, biases without weight decay, two phases, state kept."""
    torch.manual_seed(0)
    net = network()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = ClientOptimizer.from_config(CLIENT_OPTIMIZERS[name], batch_size=7, decay_bias=False)
    vctx, seq, _, _ = contexts(net, [23, 9, 31, 14], optimizer, budgets=[1.0, 1.0, 0.5, 1.0])
    template = state_template(optimizer, glob)
    vctx.optimizer_state = stack([template] * 4)
    head = [n for n in glob if n.startswith("head.")]
    params = {n: v.expand(4, *v.shape) for n, v in glob.items()}
    params = vctx.sgd(vctx.sgd(params, head, epochs=2), list(glob), epochs=1)
    for k in range(4):
        seq[k].optimizer_state = dict(template)
        expected = seq[k].sgd(seq[k].sgd(glob, head, epochs=2), list(glob), epochs=1)
        for n in glob:
            torch.testing.assert_close(params[n][k], expected[n], rtol=1e-5, atol=1e-5, msg=f"{n} client {k}")
        kept = unstack(vctx.optimizer_state, k)
        for n, v in seq[k].optimizer_state.items():
            torch.testing.assert_close(kept[n].to(v.dtype), v, rtol=1e-5, atol=1e-5, msg=f"state {n} client {k}")
    steps = seq[0].optimizer_state["client_optimizer.steps.head.bias"]
    assert int(steps) == 2 * 4 + 4  # 23 samples in batches of 7: 4 steps per epoch, head in both phases


def one_client_adam_run(keep: bool, executor: str, rounds: int = 4):
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=1, partition=Shards(10), clients_per_round=1, seed=0)
    module = FederatedModule(
        FedAvg(1),
        DigitsMLP(),
        batch_size=10_000,
        eval_every=100,
        executor=executor,
        client_optimizer=functools.partial(torch.optim.Adam, lr=0.01),
        keep_client_optimizer_state=keep,
    )
    initial = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    return fit(module, dm, rounds=rounds), dm, initial


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_kept_client_adam_state_continues_across_rounds_and_fresh_state_restarts(executor):
    """One client, one full-batch step per round, FedAvg with server lr 1: the global model follows the client.
    Kept state = one Adam run over all rounds; fresh state = a new Adam (bias-corrected first step) each round."""
    kept, dm, initial = one_client_adam_run(True, executor)
    fresh, _, _ = one_client_adam_run(False, executor)
    x, y = dm.federated.train.client(0)
    net = DigitsMLP()
    continuous, m, v = adam_reference(net, initial, x, y, 4, 0.01, (0.9, 0.999), 1e-8, 0.0, False, False)
    restarted = initial
    for _ in range(4):
        restarted, _, _ = adam_reference(net, restarted, x, y, 1, 0.01, (0.9, 0.999), 1e-8, 0.0, False, False)
    for n, p in kept.net.named_parameters():
        torch.testing.assert_close(p.detach(), continuous[n], rtol=1e-5, atol=1e-5, msg=n)
        torch.testing.assert_close(dict(fresh.net.named_parameters())[n].detach(), restarted[n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kept.bank.row(f"client_optimizer.exp_avg.{n}")[0], m[n], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(kept.bank.row(f"client_optimizer.exp_avg_sq.{n}")[0], v[n], rtol=1e-4, atol=1e-9)
        assert int(kept.bank.row(f"client_optimizer.steps.{n}")[0]) == 4
    assert not any(n.startswith("client_optimizer.") for n in fresh.bank.names)


# ---- learning-rate schedules over rounds ------------------------------------------------------------------------
class RecordingSGD(torch.optim.SGD):
    """SGD that records the learning rate of every step it takes with a gradient (what the clients actually
    used; the engine's lr carrier of the same class never has one)."""

    used: list[tuple[int, float]] = []
    module: FederatedModule | None = None

    def step(self, closure=None):
        has_grad = any(p.grad is not None for group in self.param_groups for p in group["params"])
        if RecordingSGD.module is not None and has_grad:
            RecordingSGD.used.append((RecordingSGD.module.global_step, self.param_groups[0]["lr"]))
        return super().step(closure)


def test_step_lr_changes_the_client_lr_at_the_right_rounds_and_lr_monitor_logs_both(tmp_path):
    RecordingSGD.used = []
    module = FederatedModule(
        FedAvg(1),
        DigitsMLP(),
        eval_every=100,
        client_optimizer=functools.partial(RecordingSGD, lr=0.1, momentum=0.5),
        client_lr_schedule=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.1),
        server_lr_schedule=functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5),
    )
    RecordingSGD.module = module
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    logger = CSVLogger(tmp_path, name="", version="")
    fit(module, dm, rounds=5, logger=logger, callbacks=[LearningRateMonitor()], log_every_n_steps=1)
    RecordingSGD.module = None

    used = {}
    for round_idx, lr in RecordingSGD.used:
        used.setdefault(round_idx, set()).add(round(lr, 12))
    assert used == {0: {0.1}, 1: {0.1}, 2: {0.01}, 3: {0.01}, 4: {0.001}}
    rows = [r for r in csv.DictReader(open(tmp_path / "metrics.csv")) if r.get("lr/client")]
    assert [int(r["step"]) for r in rows] == list(range(5))
    assert [float(r["lr/client"]) for r in rows] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001])
    assert [float(r["lr/server"]) for r in rows] == pytest.approx([1.0, 0.5, 0.25, 0.125, 0.0625])


@pytest.mark.parametrize("keep", [False, True])
def test_executors_agree_with_adam_a_schedule_and_fedyogi(keep):
    """eps 1e-5: with torch's 1e-8, Adam divides float32 rounding of near-zero gradients (the executors sum in
    different orders) by √v ≈ |g| and turns it into lr-sized steps (float64 agrees to 1e-15 with either eps)."""

    def run(executor):
        L.seed_everything(0, verbose=False)
        module = FederatedModule(
            FedRep(2, 1),
            DigitsMLP(),
            eval_every=1,
            executor=executor,
            client_optimizer=functools.partial(torch.optim.AdamW, lr=0.003, weight_decay=0.01, eps=1e-5),
            client_lr_schedule=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=4),
            keep_client_optimizer_state=keep,
            server_optimizer=functools.partial(FedYogi, lr=0.03),
        )
        dm = DigitsDataModule(num_clients=10, partition=Dirichlet(0.5), clients_per_round=4, seed=0)
        return fit(module, dm, rounds=4)

    seq, vec = run("sequential"), run("vectorized")
    for a, b in zip(seq.history, vec.history):
        for key in a:
            assert abs(a[key] - b[key]) < 1e-5, (key, a[key], b[key])
    for n, p in seq.net.named_parameters():
        torch.testing.assert_close(dict(vec.net.named_parameters())[n], p, rtol=1e-5, atol=1e-5)
    for n in seq.bank.names:
        torch.testing.assert_close(vec.bank.row(n), seq.bank.row(n), rtol=1e-4, atol=1e-5, msg=n)


def test_resume_is_exact_with_server_adam_client_adam_kept_state_and_a_schedule(tmp_path):
    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(
            FedAvg(1),
            DigitsMLP(),
            eval_every=1,
            eval_last=2,
            client_optimizer=functools.partial(torch.optim.Adam, lr=0.003),
            client_lr_schedule=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
            keep_client_optimizer_state=True,
            server_optimizer=functools.partial(FedAdam, lr=0.03),
        )

    def data():
        return DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=3, seed=0)

    full = fit(module(), data(), rounds=5)
    ckpt = RoundCheckpoint(  # saves after the round's validation, so a resume skips nothing
        dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    make_trainer(5, enable_checkpointing=True, callbacks=[ckpt]).fit(module(), datamodule=data())
    resumed = module()
    L.seed_everything(123, verbose=False)
    make_trainer(5).fit(resumed, datamodule=data(), ckpt_path=str(tmp_path / "r3.ckpt"))
    assert resumed.history == full.history
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n
    for n in full.bank.names:
        assert torch.equal(resumed.bank.row(n), full.bank.row(n)), n
    assert client_settings(resumed).lr == client_settings(full).lr == 0.003 / 4


# ---- configs/server/*.yaml ----------------------------------------------------------------------------------------
SERVER_FILES = {
    "fedavg": ("SGD", {"lr": 1.0, "momentum": 0.0}),
    "fedavgm": ("SGD", {"lr": 1.0, "momentum": 0.9}),
    "fedadam": ("FedAdam", {"lr": 0.01, "tau": 0.001}),
    "fedyogi": ("FedYogi", {"lr": 0.01, "tau": 0.001}),
    "fedadagrad": ("FedAdagrad", {"lr": 0.01, "tau": 0.001}),
}


@pytest.mark.parametrize("name", list(SERVER_FILES))
def test_server_config_files_compose_with_a_run_config(name, tmp_path):
    summary = train_config(
        [ROOT / "configs/quickstart.yaml", ROOT / f"configs/server/{name}.yaml"],
        ["--trainer.max_steps", "2", "--model.algorithm.init_args.head_epochs", "1", "--model.eval_last", "1"],
        run_dir=tmp_path,
    )
    assert summary["rounds"] == 2 and np.isfinite(summary["final"])
    state = torch.load(tmp_path / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    server, client = state["optimizer_states"]
    cls, expected = SERVER_FILES[name]
    group = server["param_groups"][0]
    assert {k: group[k] for k in expected} == expected
    assert ("tau" in group) == cls.startswith("Fed")
    assert [s["_last_lr"] for s in state["lr_schedulers"]] == [[expected["lr"]], [0.01]]  # server, client lr
