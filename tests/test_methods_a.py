"""Issue 17's FedBN, FedBABU, FedRoD and FedALA: each against a plain-torch reference written out here, end to end.

Each reference runs the engine for 2–3 rounds on 5 digits clients (2 classes each, every client every round,
full-batch momentum-0.5 SGD so that the order of samples does not matter) and replays the same rounds by hand: the
network's forward pass written out, torch's heavy-ball SGD written out (``HeavyBall``), the clients' local updates
as the papers define them and the server's weighted average. It then compares the global model, every client's
state in the bank and every client's evaluation. Each also runs a "role swap" of the method (FedBN averaging the
BatchNorm statistics, FedRoD's two losses exchanged, FedALA's W applied the wrong way round, FedBABU training its
head) and checks that the engine's result is far from it, so the reference can tell the method from its variants.

The rest: every method on the digits split in both executors (with held-out new clients), the one-line errors
for networks a method cannot use, the method configs on every Table-1 column, and FedBN's BatchNorm state under
checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import make_trainer
from helpers import assert_close_finite
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedALA, FedAvg, FedBABU, FedBN, FedRoD
from fl_lightning.cli import main as cli_main
from fl_lightning.cli import train_config
from fl_lightning.engine.module import FederatedModule, FineTune
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from fl_lightning.models.split import SplitModel

LR, MOM, FULL_BATCH = 0.05, 0.5, 10_000
TOL = dict(rtol=2e-4, atol=2e-5)  # float32 network; the engine sums uploads in float64


class HeavyBall:
    """torch.optim.SGD(momentum=μ) written out: b = g at the first step, b = μb + g after; p ← p − lr·b."""

    def __init__(self, lr: float = LR, mu: float = MOM) -> None:
        self.lr, self.mu, self.buf = lr, mu, {}

    def step(self, p: dict, g: dict) -> dict:
        out = dict(p)
        for n in g:
            self.buf[n] = g[n] if n not in self.buf else self.mu * self.buf[n] + g[n]
            out[n] = p[n] - self.lr * self.buf[n]
        return out


def grads(loss: torch.Tensor, p: dict, names: list[str]) -> dict:
    return dict(zip(names, torch.autograd.grad(loss, [p[n] for n in names])))


def leaves(p: dict, names: list[str]) -> dict:
    return {**p, **{n: p[n].detach().clone().requires_grad_(True) for n in names}}


def digits(num_clients: int = 5, **kw) -> DigitsDataModule:
    return DigitsDataModule(num_clients=num_clients, partition=Shards(2), participation=1.0, seed=0, **kw)


def fit(algorithm, network, rounds: int, **module_kw) -> tuple[FederatedModule, DigitsDataModule, dict]:
    """Train with every client every round, full-batch momentum SGD; returns the module, data and initial model."""
    dm = digits()
    kw = dict(lr=LR, momentum=MOM, batch_size=FULL_BATCH, eval_every=1, eval_last=1) | module_kw
    module = FederatedModule(algorithm, network, **kw)
    init = {n: t.detach().clone() for n, t in module.global_params().items()}
    make_trainer(rounds).fit(module, datamodule=dm)
    return module, dm, init


def weighted_mean(models: list[dict], sizes: list[int], names: list[str]) -> dict:
    total = sum(sizes)
    return {n: sum(s * m[n] for m, s in zip(models, sizes)) / total for n in names}


def scores(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross entropy) of one client's test logits."""
    return float((logits.argmax(-1) == y).double().mean()), float(F.cross_entropy(logits, y))


def assert_evaluation(module: FederatedModule, expected: list[tuple[float, float]]) -> None:
    result = module.last_evaluation
    for c, (acc, loss) in enumerate(expected):
        assert float(result.acc_per_client[c]) == pytest.approx(acc, abs=1e-9), c
        assert float(result.loss_per_client[c]) == pytest.approx(loss, rel=1e-4), c


def far(a: dict, b: dict, names: list[str]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


# ---- FedBN --------------------------------------------------------------------------------------------------------
class TinyBN(SplitModel):
    """64 → fc 6 → BatchNorm1d → tanh → head 10 (full batches, so BatchNorm1d always sees many samples)."""

    def __init__(self) -> None:
        body = nn.Sequential(
            OrderedDict(flatten=nn.Flatten(), fc=nn.Linear(64, 6), bn=nn.BatchNorm1d(6), act=nn.Tanh())
        )
        super().__init__(body, nn.Linear(6, 10))


BN_PARAMS = ["body.bn.weight", "body.bn.bias"]
BN_STATS = ["body.bn.running_mean", "body.bn.running_var"]
SHARED = ["body.fc.weight", "body.fc.bias", "head.weight", "head.bias"]


def tiny_bn_forward(p: dict, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
    """The forward pass by hand; in training mode also the new running statistics (momentum 0.1, unbiased var)."""
    h = x.flatten(1) @ p["body.fc.weight"].T + p["body.fc.bias"]
    stats = {}
    if train:
        mean, var = h.mean(0), h.var(0, unbiased=False)
        stats["body.bn.running_mean"] = 0.9 * p["body.bn.running_mean"] + 0.1 * mean.detach()
        stats["body.bn.running_var"] = 0.9 * p["body.bn.running_var"] + 0.1 * h.var(0, unbiased=True).detach()
        stats["body.bn.num_batches_tracked"] = p["body.bn.num_batches_tracked"] + 1
    else:
        mean, var = p["body.bn.running_mean"], p["body.bn.running_var"]
    h = torch.tanh((h - mean) / torch.sqrt(var + 1e-5) * p["body.bn.weight"] + p["body.bn.bias"])
    return h @ p["head.weight"].T + p["head.bias"], stats


def fedbn_reference(init: dict, dm, rounds: int, epochs: int, average_bn: bool = False):
    """FedBN Algorithm 1: local SGD on everything; the server averages the non-BN layers only (``average_bn``: the
    role swap, which averages the BN layers and statistics too, i.e. FedAvg)."""
    fed = dm.federated
    glob = dict(init)
    local_bn = [{n: init[n] for n in init if n.startswith("body.bn.")} for _ in range(fed.num_clients)]
    trained = SHARED + BN_PARAMS
    for _ in range(rounds):
        models, sizes = [], []
        for c in range(fed.num_clients):
            x, y = fed.train.client(c)
            p, opt = {**glob, **local_bn[c]}, HeavyBall()
            for _ in range(epochs):
                q = leaves(p, trained)
                logits, stats = tiny_bn_forward(q, x, train=True)
                p = {**opt.step(p, grads(F.cross_entropy(logits, y), q, trained)), **stats}
            models.append(p)
            sizes.append(x.shape[0])
            local_bn[c] = {n: p[n] for n in local_bn[c]}
        names = SHARED + (BN_PARAMS + BN_STATS if average_bn else [])
        glob = {**glob, **weighted_mean(models, sizes, names)}
        if average_bn:
            local_bn = [{n: glob[n] if n in names else b[n] for n in b} for b in local_bn]
    evaluation = []
    for c in range(fed.num_clients):
        x, y = fed.test.client(c)
        evaluation.append(scores(tiny_bn_forward({**glob, **local_bn[c]}, x, train=False)[0], y))
    return glob, local_bn, evaluation


def test_fedbn_keeps_batchnorm_parameters_and_statistics_local_and_averages_the_rest():
    torch.manual_seed(0)
    module, dm, init = fit(FedBN(local_epochs=3), TinyBN(), rounds=2)
    alg, bank = module.algorithm, module.bank
    assert alg.personal == ("body.bn.",)  # found from the network's BatchNorm buffers
    assert set(module.ledger.allowed) == set(SHARED)  # no BN name is ever uploaded
    glob, local_bn, evaluation = fedbn_reference(init, dm, rounds=2, epochs=3)
    net = module.global_params()
    for n in SHARED:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for n in BN_PARAMS + BN_STATS + ["body.bn.num_batches_tracked"]:
        assert torch.equal(net[n], init[n]), n  # the server's BN layer never moves
        for c in range(5):
            assert_close_finite(bank.row(n)[c], local_bn[c][n], **TOL, msg=f"client {c} {n}")
    assert bank.row("body.bn.num_batches_tracked").tolist() == [6] * 5  # 2 rounds × 3 full-batch steps
    assert_evaluation(module, evaluation)  # each client normalises with its own running statistics
    # the role swap (BN averaged like every other layer) is far from it
    swapped, swapped_bn, _ = fedbn_reference(init, dm, rounds=2, epochs=3, average_bn=True)
    assert far(net, swapped, SHARED) > 10 * TOL["atol"]
    assert max(far(bank.get(c), swapped_bn[c], BN_PARAMS + BN_STATS) for c in range(5)) > 1e-2


def test_fedbn_needs_a_batchnorm_network():
    with pytest.raises(ConfigError, match=r"FedBN needs a network with BatchNorm layers"):
        fit(FedBN(), DigitsMLP(hidden=(16,)), rounds=1)


def test_fedbn_batchnorm_state_survives_checkpoint_resume(tmp_path):
    """The clients' BatchNorm statistics (float and integer buffers) are checkpointed with the bank."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(rounds, ckpt_path=None, **trainer_kw):
        torch.manual_seed(0)
        module = FederatedModule(FedBN(), DigitsCNN(batchnorm=True), eval_every=100, eval_last=1)
        dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
        make_trainer(rounds, **trainer_kw).fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return module

    full = run(4)
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    run(4, enable_checkpointing=True, callbacks=[ckpt])
    resumed = run(4, ckpt_path=str(tmp_path / "r2.ckpt"))
    counts = full.bank.row("body.bn1.num_batches_tracked")
    assert counts.dtype == torch.long and len(set(counts.tolist())) > 1  # clients trained different amounts
    for n in full.bank.names:
        assert torch.equal(resumed.bank.row(n), full.bank.row(n)), n
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n


# ---- FedBABU ------------------------------------------------------------------------------------------------------
MLP = ["body.fc1.weight", "body.fc1.bias", "head.weight", "head.bias"]
BODY, HEAD = MLP[:2], MLP[2:]


def mlp_forward(p: dict, x: torch.Tensor, head: str = "head.") -> torch.Tensor:
    """DigitsMLP(hidden=(16,)) by hand: relu(x W₁ᵀ + b₁) W_hᵀ + b_h."""
    return mlp_features(p, x) @ p[head + "weight"].T + p[head + "bias"]


def mlp_features(p: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x.flatten(1) @ p["body.fc1.weight"].T + p["body.fc1.bias"])


def local_sgd(p: dict, names: list[str], x, y, epochs: int) -> dict:
    opt = HeavyBall()
    for _ in range(epochs):
        q = leaves(p, names)
        p = opt.step(p, grads(F.cross_entropy(mlp_forward(q, x), y), q, names))
    return p


def fedbabu_reference(init: dict, dm, rounds: int, epochs: int, trained: list[str], ft_epochs: int, ft: list[str]):
    """FedBABU: local SGD on the body with the random head fixed, average the bodies; then every client fine-tunes
    ``ft`` for ``ft_epochs`` from the global model and is scored once."""
    fed, glob = dm.federated, dict(init)
    for _ in range(rounds):
        models = [local_sgd(glob, trained, *fed.train.client(c), epochs) for c in range(fed.num_clients)]
        sizes = [fed.train.client(c)[0].shape[0] for c in range(fed.num_clients)]
        glob = {**glob, **weighted_mean(models, sizes, trained)}
    evaluation = []
    for c in range(fed.num_clients):
        tuned = local_sgd(glob, ft, *fed.train.client(c), ft_epochs)
        x, y = fed.test.client(c)
        evaluation.append(scores(mlp_forward(tuned, x), y))
    return glob, evaluation


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedbabu_trains_the_body_through_a_fixed_random_head_then_fine_tunes_the_head(executor):
    torch.manual_seed(0)
    finetune = FineTune(epochs=2, prefixes=("head.",))
    module, dm, init = fit(FedBABU(local_epochs=2), DigitsMLP(hidden=(16,)), 2, finetune=finetune, executor=executor)
    assert set(module.ledger.allowed) == set(BODY)  # the head is never uploaded
    glob, evaluation = fedbabu_reference(init, dm, 2, 2, BODY, 2, HEAD)
    net = module.global_params()
    for n in BODY:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for n in HEAD:
        assert torch.equal(net[n], init[n]), n  # the random head never moves
    # "+FT": the head fine-tuned for 2 epochs per client on the trained body, scored once (the run's result)
    result = module.evaluate_clients(1, finetune=finetune)
    for c, (acc, loss) in enumerate(evaluation):
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9)
        assert float(result["loss_per_client"][c]) == pytest.approx(loss, rel=1e-4)
    assert module.summary["algorithm"] == "FedBABU+FT" and module.summary["final_ft"] == pytest.approx(
        float(result["acc_mean"]), abs=1e-12
    )  # the "+FT" figure under its own name (issue 31); final is the plain run's
    # role swaps: training the head with the body (FedAvg), or fine-tuning the whole network
    fedavg, _ = fedbabu_reference(init, dm, 2, 2, MLP, 2, HEAD)
    assert far(net, fedavg, BODY) > 1e-3
    _, whole = fedbabu_reference(init, dm, 2, 2, BODY, 2, MLP)
    assert max(abs(a[1] - b[1]) for a, b in zip(whole, evaluation)) > 1e-3


# ---- FedRoD -------------------------------------------------------------------------------------------------------
def fedrod_reference(init: dict, dm, rounds: int, epochs: int, swap: bool = False):
    """Per full batch, from the same forward pass: body + generic head step on the balanced softmax loss
    CE(h_G(z) + log π, y); the personal head steps on CE(h_G(z).detach() + h_P(z.detach()), y). ``swap``: the roles
    exchanged (generic head on plain CE, personal head on the balanced loss)."""
    fed, glob = dm.federated, dict(init)
    personal = [{"p.weight": torch.zeros(10, 16), "p.bias": torch.zeros(10)} for _ in range(fed.num_clients)]
    for _ in range(rounds):
        models, sizes = [], []
        for c in range(fed.num_clients):
            x, y = fed.train.client(c)
            counts = torch.bincount(y, minlength=10).float()
            log_prior = torch.log(counts / counts.sum())  # −inf for the 8 classes the client does not have
            p, opt_g, opt_p = {**glob, **personal[c]}, HeavyBall(), HeavyBall()
            for _ in range(epochs):
                q = leaves(p, MLP + ["p.weight", "p.bias"])
                z = mlp_features(q, x)
                g = z @ q["head.weight"].T + q["head.bias"]
                h = z.detach() @ q["p.weight"].T + q["p.bias"]
                loss_g = F.cross_entropy(g + (0 if swap else log_prior), y)
                loss_p = F.cross_entropy(g.detach() + h + (log_prior if swap else 0), y)
                p = opt_g.step(p, grads(loss_g, q, MLP))  # both steps from the same pre-step parameters q
                p = opt_p.step(p, grads(loss_p, q, ["p.weight", "p.bias"]))
            models.append(p)
            sizes.append(x.shape[0])
            personal[c] = {n: p[n] for n in ("p.weight", "p.bias")}
        glob = {**glob, **weighted_mean(models, sizes, MLP)}
    evaluation = []
    for c in range(fed.num_clients):
        x, y = fed.test.client(c)
        evaluation.append(scores(mlp_forward(glob, x) + mlp_forward({**glob, **personal[c]}, x, head="p."), y))
    return glob, personal, evaluation


def test_fedrod_generic_head_on_balanced_softmax_and_personal_head_on_top():
    torch.manual_seed(0)
    module, dm, init = fit(FedRoD(local_epochs=3), DigitsMLP(hidden=(16,)), rounds=2)
    glob, personal, evaluation = fedrod_reference(init, dm, rounds=2, epochs=3)
    net = module.global_params()
    for n in MLP:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for c in range(5):
        for n in ("weight", "bias"):
            assert_close_finite(module.bank.row("p_head.head." + n)[c], personal[c]["p." + n], **TOL)
    assert_evaluation(module, evaluation)  # the prediction is h_G(z) + h_P(z)
    swapped, _, _ = fedrod_reference(init, dm, rounds=2, epochs=3, swap=True)
    assert far(net, swapped, MLP) > 1e-3


TWO_LAYER_HEAD = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(64, 8)), nn.Sequential(nn.ReLU(), nn.Linear(8, 10)))


@pytest.mark.parametrize(
    "network, match", [(TWO_LAYER_HEAD, "head.1."), (nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), "no parameters")]
)
def test_fedrod_needs_a_linear_classifier_head(network, match):
    with pytest.raises(ConfigError, match=rf"FedRoD needs a network whose `head` is one linear.*{match}"):
        fit(FedRoD(), network, rounds=1)


# ---- FedALA -------------------------------------------------------------------------------------------------------

def fedala_reference(init: dict, dm, rounds: int, s: float, eta: float, settle_epochs: int, wrong_way: bool = False):
    """FedALA with p = 1 (the head): round 0 starts from Θ; later rounds learn W on a random s % sample (the
    client's round generator draws it, then shuffles it each ALA epoch), θ̂ = θ + (Θ − θ) ⊙ W clipped to [0, 1],
    ``settle_epochs`` ALA epochs the first time, 1 after; then one full-batch epoch of local SGD from θ̂.
    ``wrong_way``: θ̂ = Θ + (θ − Θ) ⊙ W."""
    fed, glob = dm.federated, dict(init)
    local = [{n: init[n] for n in HEAD} for _ in range(fed.num_clients)]
    weights = [{n: torch.ones_like(init[n]) for n in HEAD} for _ in range(fed.num_clients)]

    def mixed(c: int) -> dict:
        a, b = (local[c], glob) if not wrong_way else (glob, local[c])
        return {n: a[n] + (b[n] - a[n]) * weights[c][n] for n in HEAD}

    for r in range(rounds):
        models, sizes = [], []
        for c in range(fed.num_clients):
            x, y = fed.train.client(c)
            gen = make_generator(dm.federated.seed, "train", r, c)
            if r == 0:
                start = dict(glob)
            else:
                sample = torch.randperm(x.shape[0], generator=gen)[: int(s / 100 * x.shape[0])]
                xs, ys = x[sample], y[sample]
                for _ in range(settle_epochs if r == 1 else 1):
                    order = torch.randperm(xs.shape[0], generator=gen)
                    q = leaves({**glob, **mixed(c)}, HEAD)
                    g = grads(F.cross_entropy(mlp_forward(q, xs[order]), ys[order]), q, HEAD)
                    gap = {n: glob[n] - local[c][n] for n in HEAD} if not wrong_way else {
                        n: local[c][n] - glob[n] for n in HEAD
                    }
                    weights[c] = {n: (weights[c][n] - eta * g[n] * gap[n]).clamp(0, 1) for n in HEAD}
                start = {**glob, **mixed(c)}
            order = torch.randperm(x.shape[0], generator=gen)
            p = local_sgd(start, MLP, x[order], y[order], epochs=1)
            models.append(p)
            sizes.append(x.shape[0])
            local[c] = {n: p[n] for n in HEAD}
        glob = {**glob, **weighted_mean(models, sizes, MLP)}
    evaluation = []
    for c in range(fed.num_clients):
        x, y = fed.test.client(c)
        evaluation.append(scores(mlp_forward({**glob, **mixed(c)}, x), y))
    return glob, local, weights, evaluation


def test_fedala_learns_elementwise_aggregation_weights_for_the_top_layer():
    torch.manual_seed(0)
    # threshold 1e9 with window 2: the first ALA stops after 2 epochs (its loss "settles" at once); η large so W moves
    alg = FedALA(local_epochs=1, p=1, s=50.0, eta=30.0, threshold=1e9, window=2, init_max_epochs=5)
    module, dm, init = fit(alg, DigitsMLP(hidden=(16,)), rounds=3)
    glob, local, weights, evaluation = fedala_reference(init, dm, rounds=3, s=50.0, eta=30.0, settle_epochs=2)
    net, bank = module.global_params(), module.bank
    for n in MLP:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for c in range(5):
        for n in HEAD:
            assert_close_finite(bank.row("local." + n)[c], local[c][n], **TOL, msg=f"client {c} local {n}")
            assert_close_finite(bank.row("ala_w." + n)[c], weights[c][n], **TOL, msg=f"client {c} W {n}")
    assert bank.row("ala_runs").tolist() == [3] * 5
    w = torch.cat([bank.row("ala_w." + n).flatten() for n in HEAD])
    assert ((w > 0.01) & (w < 0.99)).any() and ((w == 0) | (w == 1)).float().mean() > 0.1  # learned, and clipped
    assert_evaluation(module, evaluation)  # evaluated with θ + (Θ − θ) ⊙ W from the current Θ
    wrong, _, _, _ = fedala_reference(init, dm, rounds=3, s=50.0, eta=30.0, settle_epochs=2, wrong_way=True)
    assert far(net, wrong, MLP) > 1e-3
    later, _, _, _ = fedala_reference(init, dm, rounds=3, s=50.0, eta=30.0, settle_epochs=1)  # no settling phase
    assert far(net, later, MLP) > 1e-4


def test_fedala_layers_and_its_p_check():
    alg = FedALA(p=2)
    params = {n: t.detach() for n, t in DigitsCNN(batchnorm=True).state_dict().items()}
    assert list(alg.layers(params)) == ["body.conv1", "body.bn1", "body.conv2", "body.bn2", "body.fc1", "head"]
    assert alg.top_names(params) == ["body.fc1.weight", "body.fc1.bias", "head.weight", "head.bias"]
    with pytest.raises(ConfigError, match=r"FedALA: p = 7 top layers .* has 6 layers"):
        FedALA(p=7).setup(params, 10)


# ---- every method on digits, both executors, with held-out new clients -------------------------------------------
class DigitsWithNewClients(DigitsDataModule):
    """Digits with 5 held-out clients (another partition seed) that never train (FedRep Fig. 6-style)."""

    def setup(self, stage=None):
        super().setup(stage)
        other = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
        other.setup()
        self.new_clients = other.federated


METHODS = ["fedbn", "fedbabu", "fedrod", "fedala"]
NEW_CLIENTS = [
    "--data", "test_methods_a.DigitsWithNewClients", "--data.init_args.num_clients", "10",
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
    expected = {
        "fedbn": "the network has BatchNorm layers",
        "fedrod": "FedRoD is not marked vectorizable",
        "fedala": "FedALA is not marked vectorizable",
    }
    if method in expected:
        assert len(fallback) == 1 and expected[method] in fallback[0]
    else:
        assert not fallback  # FedBABU runs on the vectorized executor itself


def test_fedrod_new_clients_train_their_personal_head_from_zero():
    """A held-out client starts with h_P = 0 (its model is the generic one) and fine-tunes ``head.`` of h_G + h_P:
    by linearity that is training h_P on CE(h_G(z) + h_P(z)) with everything else fixed (plain-torch loop here)."""
    torch.manual_seed(0)
    dm = digits()
    new = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
    new.setup()
    module = FederatedModule(
        FedRoD(), DigitsMLP(hidden=(16,)), lr=LR, batch_size=FULL_BATCH, eval_every=1, eval_last=1,
        new_client_finetune=FineTune(epochs=3, prefixes=("head.",)),
    )  # fmt: skip
    make_trainer(2).fit(module, datamodule=dm)
    result = module.evaluate_new_clients(1, new.federated)
    glob = {n: t.detach().clone() for n, t in module.global_params().items()}
    for c in range(5):
        x, y = new.federated.train.client(c)
        p = {**glob, "p.weight": torch.zeros(10, 16), "p.bias": torch.zeros(10)}
        opt = HeavyBall()
        for _ in range(3):
            q = leaves(p, ["p.weight", "p.bias"])
            logits = mlp_forward(glob, x).detach() + mlp_forward(q, x, head="p.")
            p = opt.step(p, grads(F.cross_entropy(logits, y), q, ["p.weight", "p.bias"]))
        xt, yt = new.federated.test.client(c)
        acc, loss = scores(mlp_forward(glob, xt) + mlp_forward(p, xt, head="p."), yt)
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9)
        assert float(result["loss_per_client"][c]) == pytest.approx(loss, rel=1e-4)


# ---- bad input: one line, exit code 2 -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "configs, overrides, message",
    [
        (["configs/digits/fedbn.yaml"], ["--model.network", "fl_lightning.models.DigitsMLP"], "FedBN needs a network"),
        (
            ["configs/digits/fedrod.yaml"],
            ["--model.network", "fl_lightning.models.ClusteredLinear", "--model.network.init_args.dim", "64"],
            "FedRoD needs a network whose `head`",
        ),
        (
            ["configs/digits/fedbabu.yaml"],
            ["--model.network", "fl_lightning.models.ClusteredLinear", "--model.network.init_args.dim", "64"],
            "FedBABU needs a network with a `head`",
        ),
        (["configs/digits/fedala.yaml"], ["--model.algorithm.init_args.p", "4"], "FedALA: p = 4 top layers"),
    ],
)
def test_a_method_on_a_network_it_cannot_use_stops_with_one_line(configs, overrides, message, tmp_path, capsys):
    args = ["--config", "configs/digits/base.yaml", *(a for c in configs for a in ("--config", c)), *overrides]
    assert cli_main([*args, "--run_dir", str(tmp_path), "--trainer.logger", "false"]) == 2
    assert message in error_line(capsys.readouterr().err)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "checkpoints").exists()  # before training


def error_line(captured: str) -> str:
    """The one ``error:`` line of a failed run (and no traceback)."""
    lines = [ln for ln in captured.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in captured, captured[-2000:]
    return lines[0]


# ---- the method configs on every Table-1 column (dry runs on the tiny real-format fixtures) -----------------------
def table1_cell(column: str, method: str) -> list[Path]:
    """A pFL baseline on a Table-1 column: the column's config, then the method's."""
    return [Path("configs/table1") / f"{column}.yaml", Path("configs/methods") / f"{method}.yaml"]


@pytest.mark.parametrize("method", METHODS)
def test_method_configs_run_on_every_table1_column(method, tmp_path, capsys):
    from data_fixtures import make_fixture

    from experiments.table1 import REAL_COLUMNS

    for column in REAL_COLUMNS:
        configs, overrides = table1_cell(column, method), []
        extra = [*overrides, *make_fixture(column, tmp_path / column), "--model.eval_last=1"]
        extra += ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
        extra += ["--model.algorithm.init_args.local_epochs=1", "--run_dir", str(tmp_path / f"run_{column}")]
        extra += ["--model.finetune.epochs=1"] if method == "fedbabu" else []
        if method == "fedbn" and not column.startswith("cifar"):  # no BatchNorm variant: one line, exit code 2
            args = [a for c in configs for a in ("--config", str(c))]
            assert cli_main([*args, *extra]) == 2
            line = error_line(capsys.readouterr().err)
            assert "has no BatchNorm variant" in line and "FedBN needs" in line
            continue
        summary = train_config(configs, extra)
        assert summary["rounds"] == 1 and 0.0 <= summary["last10"] <= 1.0 and not math.isnan(summary["last10"])


def test_fedbn_configs_select_the_batchnorm_variant_of_the_columns_network():
    import yaml

    for column, wide in (("cifar10_100x2", False), ("cifar100_100x5", True)):
        configs = table1_cell(column, "fedbn")
        merged: dict = {}
        for c in configs:
            net = yaml.safe_load(open(c))["model"].get("network", {})
            merged.update(net.get("init_args", {}))
            merged.setdefault("class_path", net.get("class_path"))
        assert merged["class_path"] == "fl_lightning.models.CifarCNN" and merged["batchnorm"] is True
        assert merged.get("wide", False) is wide
    digits_net = yaml.safe_load(open("configs/digits/fedbn.yaml"))["model"]["network"]
    assert digits_net == {"class_path": "fl_lightning.models.DigitsCNN", "init_args": {"batchnorm": True}}


def test_batchnorm_variants_only_add_batchnorm_layers():
    plain, bn = DigitsCNN(), DigitsCNN(batchnorm=True)
    extra = {n for n, _ in bn.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert extra == {"body.bn1.weight", "body.bn1.bias", "body.bn2.weight", "body.bn2.bias"}
    from fl_lightning.models import CifarCNN

    plain, bn = CifarCNN(wide=True), CifarCNN(wide=True, batchnorm=True)
    assert {n for n, _ in plain.named_parameters()} < {n for n, _ in bn.named_parameters()}
    assert bn(torch.randn(1, 3, 32, 32)).shape == (1, 10)  # a one-sample batch trains (no BatchNorm1d)
    assert DigitsCNN(batchnorm=True)(torch.randn(1, 1, 8, 8)).shape == (1, 10)


def test_fedavg_on_a_batchnorm_network_still_averages_the_statistics():
    """The engine's default: without FedBN, BN layers and their statistics are shared like any other layer."""
    torch.manual_seed(0)
    module, _, init = fit(FedAvg(local_epochs=1), TinyBN(), rounds=1)
    assert {"body.bn.running_mean", "body.bn.num_batches_tracked"} <= set(module.ledger.allowed)
    assert not torch.equal(module.global_params()["body.bn.running_mean"], init["body.bn.running_mean"])
