"""Definitions pinned by tests that compute them independently (issue 20, item 3).

1. Which parameters each algorithm keeps personal, by parameter name (FedAvg, FedPer, FedRep, LG-FedAvg,
   Local Only, L2GD, Fed-MTL).
2. Each algorithm's client update against a plain-torch reference written here by hand (forward pass,
   gradients, SGD with momentum), on a case where swapping a role (personal/global start, which parameters a
   phase trains, the phase order, the sign of a step or of a correction, what is uploaded) changes the result,
   and the test asserts that the swapped variant is far from the actual update.
   Per-FedAvg, SCAFFOLD, APFL, Ditto, FedProx and FedMD are pinned in their own test files.
3. The reported metrics from per-client counts written out here: the mean over clients with test data, the
   sample-weighted accuracy, the last-N mean over exactly N evaluations, bytes uploaded and downloaded.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_close_finite, assert_params_close_finite
from torch import nn
from torch.nn import functional as F

from fl_lightning.algorithms import L2GD, FedAvg, FedMTL, FedPer, FedRep, LGFedAvg, LocalOnly
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.metrics import PerClientScores
from fl_lightning.models import CifarCNN, DigitsMLP
from fl_lightning.models.split import SplitModel

ROOT = Path(__file__).resolve().parents[1]

# ---- 1. personal / shared split by parameter name -------------------------------------------------------------
CIFAR_BODY_LOWER = ["body.conv1.weight", "body.conv1.bias", "body.conv2.weight", "body.conv2.bias"]
CIFAR_BODY_UPPER = ["body.fc1.weight", "body.fc1.bias", "body.fc2.weight", "body.fc2.bias"]
CIFAR_HEAD = ["head.weight", "head.bias"]


def cifar_params() -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in CifarCNN().named_parameters()}
    assert list(params) == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER + CIFAR_HEAD  # the names the splits below use
    return params


def split_of(algorithm) -> tuple[list[str], list[str], list[str], list[str]]:
    """(personal, shared, uploaded, client-state) parameter names on the FedRep CIFAR CNN."""
    params = cifar_params()
    return (
        algorithm.personal_names(params),
        algorithm.shared_names(params),
        list(algorithm.upload_template(params)),
        list(algorithm.init_client_state(params)),
    )


def test_fedper_default_split_personal_head():
    """FedPer (spec 000 §2.4): the head (final layer) stays on the client, the body is averaged."""
    personal, shared, upload, state = split_of(FedPer())
    assert personal == state == CIFAR_HEAD
    assert shared == upload == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER


def test_fedrep_default_split_personal_head():
    """FedRep (spec 000 Algorithm 1): personal heads, shared representation (body)."""
    personal, shared, upload, state = split_of(FedRep())
    assert personal == state == CIFAR_HEAD
    assert shared == upload == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER


def test_lg_fedavg_default_split_is_personal_lower_layers_and_shared_head():
    """LG-FedAvg (spec 000 §2.4 table: "own local repr. + global head"): the lower layers (the body) are
    personal and the upper layers (the head) shared, the opposite of FedPer's split."""
    personal, shared, upload, state = split_of(LGFedAvg())
    assert personal == state == CIFAR_BODY_LOWER + CIFAR_BODY_UPPER
    assert shared == upload == CIFAR_HEAD
    assert personal != split_of(FedPer())[0]


def test_lg_fedavg_table1_config_keeps_the_two_conv_layers_local():
    """configs/methods/lg_fedavg.yaml (spec 000 §2.4: "the first two convolutional layers … as the local
    representation, and the fully-connected layers as the global parameters")."""
    cfg = yaml.safe_load((ROOT / "configs" / "methods" / "lg_fedavg.yaml").read_text())
    algorithm = cfg["model"]["algorithm"]
    assert algorithm["class_path"] == "fl_lightning.algorithms.LGFedAvg"
    personal, shared, upload, state = split_of(LGFedAvg(personal=algorithm["init_args"]["personal"]))
    assert personal == state == CIFAR_BODY_LOWER
    assert shared == upload == CIFAR_BODY_UPPER + CIFAR_HEAD


def test_digits_method_configs_split():
    """The quickstart configs: FedPer/FedRep personal head, LG-FedAvg personal body, Local everything."""
    digits = [n for n, _ in DigitsMLP().named_parameters()]
    body, head = [n for n in digits if n.startswith("body.")], [n for n in digits if n.startswith("head.")]
    assert body and head and body + head == digits
    params = {n: p.detach() for n, p in DigitsMLP().named_parameters()}
    expected = {"fedper": head, "fedrep": head, "lg_fedavg": body, "local": digits, "fedavg": []}
    for name, want in expected.items():
        cfg = yaml.safe_load((ROOT / "configs" / "digits" / f"{name}.yaml").read_text())["model"]["algorithm"]
        cls = {"FedPer": FedPer, "FedRep": FedRep, "LGFedAvg": LGFedAvg, "LocalOnly": LocalOnly, "FedAvg": FedAvg}[
            cfg["class_path"].rsplit(".", 1)[1]
        ]
        algorithm = cls(**(cfg.get("init_args") or {}))
        assert algorithm.personal_names(params) == want, name
        assert list(algorithm.upload_template(params)) == [n for n in digits if n not in want], name


def test_local_only_keeps_everything_and_fedavg_nothing():
    params = cifar_params()
    personal, shared, upload, state = split_of(LocalOnly())
    assert personal == state == list(params) and shared == upload == []
    personal, shared, upload, state = split_of(FedAvg())
    assert personal == state == [] and shared == upload == list(params)


@pytest.mark.parametrize("cls, local, delta", [(L2GD, "x.", "delta_x."), (FedMTL, "w.", "delta_w.")])
def test_full_local_model_methods_keep_the_model_and_upload_only_deltas(cls, local, delta):
    """L2GD and Fed-MTL: every client keeps a whole model x_i / w_i; it uploads Δ only, never a parameter."""
    params = cifar_params()
    algorithm = cls()
    algorithm.setup(params, num_clients=10)
    assert list(algorithm.init_client_state(params)) == [local + n for n in params]
    assert list(algorithm.upload_template(params)) == [delta + n for n in params]
    state = {local + n: torch.full_like(t, float(i)) for i, (n, t) in enumerate(params.items())}
    model = algorithm.client_model(params, state)
    assert all(torch.equal(model[n], state[local + n]) for n in params)  # evaluated with its own model


# ---- 2. client updates against hand-written references ----------------------------------------------------------
NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
BODY, HEAD = NAMES[:2], NAMES[2:]
LR, MOMENTUM = 0.2, 0.5


def forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The tiny network written out: logits = W₂ tanh(W₁x + b₁) + b₂."""
    return torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"]) @ p["head.weight"].T + p["head.bias"]


def nll(p, x, y):
    return -(forward(p, x).log_softmax(-1).gather(1, y[:, None])).mean()


def reference_sgd(p, x, y, trainable, steps, penalty=None, lr=LR, momentum=MOMENTUM):
    """Full-batch SGD with heavy-ball momentum (v ← μv + g, w ← w − ηv; a fresh v per call) on ``trainable``."""
    p = {n: t.clone() for n, t in p.items()}
    v = {n: torch.zeros_like(p[n]) for n in trainable}
    for _ in range(steps):
        leaves = {n: t.clone().requires_grad_(n in trainable) for n, t in p.items()}
        loss = nll(leaves, x, y) + (penalty(leaves) if penalty else 0.0)
        grads = torch.autograd.grad(loss, [leaves[n] for n in trainable])
        for n, g in zip(trainable, grads):
            v[n] = momentum * v[n] + g
            p[n] = p[n] - lr * v[n]
    return p


def rand_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"body.0.weight": (3, 4), "body.0.bias": (3,), "head.weight": (2, 3), "head.bias": (2,)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


def far(a: dict, b: dict, names=NAMES, gap: float = 1e-3) -> bool:
    """The two parameter sets differ by more than ``gap`` somewhere (the swapped role is detectable)."""
    return max(float((a[n] - b[n]).abs().max()) for n in names) > gap


@pytest.fixture
def client():
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(3, 2)).double()
    assert [n for n, _ in net.named_parameters()] == NAMES
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])

    def ctx(momentum: float = MOMENTUM) -> ClientContext:
        opt = ClientOptimizer(lr=LR, momentum=momentum, weight_decay=0.0, batch_size=100)  # full batch
        return ClientContext(net, 0, x, y, None, opt, F.cross_entropy, torch.Generator().manual_seed(2))

    return ctx, x, y


def test_fedavg_client_update_is_local_sgd_from_the_global_model(client):
    ctx, x, y = client
    glob = rand_params(1)
    upd = FedAvg(local_epochs=3).client_update(ctx(), glob, {})
    want = reference_sgd(glob, x, y, NAMES, 3)
    assert list(upd.upload) == NAMES and upd.state == {} and upd.num_samples == 8
    assert_params_close_finite(upd.upload, want, rtol=1e-9, atol=1e-10)
    ascent = reference_sgd(glob, x, y, NAMES, 3, lr=-LR)  # sign of the step
    no_momentum = reference_sgd(glob, x, y, NAMES, 3, momentum=0.0)
    assert far(upd.upload, ascent) and far(upd.upload, no_momentum)


def test_fedper_trains_personal_head_and_global_body_jointly(client):
    ctx, x, y = client
    glob, own = rand_params(2), rand_params(3)
    head = {n: own[n] for n in HEAD}
    upd = FedPer(local_epochs=2).client_update(ctx(), glob, head)
    start = {**glob, **head}  # global body, the client's own head
    want = reference_sgd(start, x, y, NAMES, 2)
    assert list(upd.upload) == BODY and list(upd.state) == HEAD
    assert_params_close_finite({**upd.upload, **upd.state}, want, rtol=1e-9, atol=1e-10)
    from_global_head = reference_sgd(glob, x, y, NAMES, 2)  # personal/global swapped at the start
    body_only = reference_sgd(start, x, y, BODY, 2)  # head not trained
    assert far({**upd.upload, **upd.state}, from_global_head) and far(upd.state, body_only, HEAD)


def test_lg_fedavg_default_trains_personal_body_and_global_head_jointly(client):
    ctx, x, y = client
    glob, own = rand_params(4), rand_params(5)
    body = {n: own[n] for n in BODY}
    upd = LGFedAvg(local_epochs=2).client_update(ctx(), glob, body)
    start = {**glob, **body}  # the client's own lower layers, the global head
    want = reference_sgd(start, x, y, NAMES, 2)
    assert list(upd.upload) == HEAD and list(upd.state) == BODY
    assert_params_close_finite({**upd.upload, **upd.state}, want, rtol=1e-9, atol=1e-10)
    assert far({**upd.upload, **upd.state}, reference_sgd(glob, x, y, NAMES, 2))  # global body at the start


def test_fedrep_head_phase_then_body_phase(client):
    """FedRep (spec 000 Algorithm 1): τ_h epochs on the client's head with the global body frozen, then τ_φ
    epochs on the body with the new head frozen; a fresh optimiser per phase; the body is uploaded and the
    head after the head phase is kept."""
    ctx, x, y = client
    glob, own = rand_params(6), rand_params(7)
    head0 = {n: own[n] for n in HEAD}
    upd = FedRep(head_epochs=3, body_epochs=2).client_update(ctx(), glob, head0)
    after_head = reference_sgd({**glob, **head0}, x, y, HEAD, 3)
    after_body = reference_sgd(after_head, x, y, BODY, 2)
    assert list(upd.upload) == BODY and list(upd.state) == HEAD
    assert_params_close_finite(upd.upload, after_body, BODY, rtol=1e-9, atol=1e-10)
    assert_params_close_finite(upd.state, after_head, HEAD, rtol=1e-9, atol=1e-10)
    # each swapped role gives numbers far from the update
    body_first = reference_sgd(reference_sgd({**glob, **head0}, x, y, BODY, 2), x, y, HEAD, 3)
    assert far(upd.upload, body_first, BODY) and far(upd.state, body_first, HEAD)
    joint = reference_sgd({**glob, **head0}, x, y, NAMES, 3)  # one phase trains everything
    assert far(upd.state, joint, HEAD)
    global_head = reference_sgd(reference_sgd(glob, x, y, HEAD, 3), x, y, BODY, 2)
    assert far(upd.upload, global_head, BODY)
    epochs_swapped = reference_sgd(reference_sgd({**glob, **head0}, x, y, HEAD, 2), x, y, BODY, 3)
    assert far(upd.upload, epochs_swapped, BODY)


def test_local_only_trains_its_own_model_and_uploads_nothing(client):
    ctx, x, y = client
    glob, own = rand_params(8), rand_params(9)
    upd = LocalOnly(local_epochs=2).client_update(ctx(), glob, own)
    assert upd.upload == {} and list(upd.state) == NAMES
    want = reference_sgd(own, x, y, NAMES, 2)
    assert_params_close_finite(upd.state, want, rtol=1e-9, atol=1e-10)
    assert far(upd.state, reference_sgd(glob, x, y, NAMES, 2))


def test_l2gd_local_step_from_own_model_and_pull_towards_the_mean(client):
    """L2GD (spec 000 §2.4): a local round trains x_i (not x̄); an aggregation round moves x_i ← (1 − ηλ)x_i + ηλx̄
    (towards the mean, not away, not the roles of x_i and x̄ swapped); Δx_i = new − old is uploaded. The coin
    is one per round, the same for every client."""
    ctx, x, y = client
    xbar, xi = rand_params(10), rand_params(11)
    alg = L2GD(p=0.5, alpha=0.2, lam=1.0, local_epochs=2)
    alg.setup(xbar, num_clients=4)
    a = 0.2 * 1.0 / (4 * (1 - 0.5))  # ηλ with η = α/(N(1−p))
    state = {"x." + n: xi[n] for n in NAMES}
    coins = [alg.aggregation_round(0, r) for r in range(40)]
    assert 5 < sum(coins) < 35
    for r in (coins.index(True), coins.index(False)):
        c = ctx()
        c.round = r
        upd = alg.client_update(c, xbar, state)
        new = {n: upd.state["x." + n] for n in NAMES}
        want = {n: (1 - a) * xi[n] + a * xbar[n] for n in NAMES} if coins[r] else reference_sgd(xi, x, y, NAMES, 2)
        assert_params_close_finite(new, want, rtol=1e-9, atol=1e-10)
        if coins[r]:  # x_i and x̄ swapped; pushed away from x̄
            assert far(new, {n: (1 - a) * xbar[n] + a * xi[n] for n in NAMES})
            assert far(new, {n: (1 + a) * xi[n] - a * xbar[n] for n in NAMES})
        else:  # trained from x̄ instead of x_i
            assert far(new, reference_sgd(xbar, x, y, NAMES, 2))
        delta = {n: upd.upload["delta_x." + n] for n in NAMES}
        assert_params_close_finite(delta, {n: want[n] - xi[n] for n in NAMES}, rtol=1e-9, atol=1e-10)
        other = ctx()
        other.client, other.round = 3, r  # another client in the same round takes the same branch
        assert_params_close_finite({n: alg.client_update(other, xbar, state).state["x." + n] for n in NAMES}, want)


@pytest.mark.parametrize("cls, local, delta", [(L2GD, "x.", "delta_x."), (FedMTL, "w.", "delta_w.")])
def test_server_keeps_the_population_mean_from_deltas(client, cls, local, delta):
    """x̄ ← x̄ + (|S|/N)·mean_S Δx_i: after |S| = 2 client updates of N = 8 clients, the mean moves by a quarter
    of the cohort's mean delta (the six other clients did not move), in the delta's direction."""
    ctx, _, _ = client
    glob = rand_params(14)
    alg = cls()
    alg.setup(glob, num_clients=8)
    for _ in range(2):  # this round's cohort
        alg.client_update(ctx(), glob, {local + n: glob[n] for n in NAMES})
    alg.num_aggregated = 2  # |S|: the engine sets the number of uploads it aggregated before the server step
    avg = {delta + n: torch.full_like(glob[n], 0.5) * (i + 1) for i, n in enumerate(NAMES)}
    live = {n: t.clone() for n, t in glob.items()}
    alg.server_update(live, avg, round_idx=0)
    want = {n: glob[n] + 2 / 8 * 0.5 * (i + 1) for i, n in enumerate(NAMES)}
    assert_params_close_finite(live, want, rtol=0, atol=1e-12)


def test_fedmtl_step_from_own_model_anchored_at_the_mean(client):
    """Fed-MTL: SGD on f_i(w) + s(‖w‖² + ‖w − w̄‖²) from the client's own w_i with the mean w̄ held fixed; the
    regulariser pulls towards w̄ (its sign), and w_i and w̄ are not swapped."""
    ctx, x, y = client
    mean, wi = rand_params(12), rand_params(13)
    s = 0.05
    alg = FedMTL(local_epochs=3, reg_scale=s)
    alg.setup(mean, num_clients=5)
    upd = alg.client_update(ctx(), mean, {"w." + n: wi[n] for n in NAMES})

    def reg(anchor, sign=1.0):
        return lambda p: s * sum((p[n] ** 2).sum() + sign * ((p[n] - anchor[n]) ** 2).sum() for n in NAMES)

    want = reference_sgd(wi, x, y, NAMES, 3, penalty=reg(mean))
    new = {n: upd.state["w." + n] for n in NAMES}
    assert_params_close_finite(new, want, rtol=1e-9, atol=1e-10)
    assert far(new, reference_sgd(mean, x, y, NAMES, 3, penalty=reg(wi)))  # roles of w_i and w̄ swapped
    assert far(new, reference_sgd(wi, x, y, NAMES, 3, penalty=reg(mean, -1.0)), gap=1e-4)  # pushed away


# ---- 3. metrics -------------------------------------------------------------------------------------------------
def test_per_client_scores_from_hand_counts():
    """Five clients with (correct, total, summed loss) written out; client 2 has no test data."""
    counts = [(9, 10, 3.0), (1, 4, 6.0), (0, 0, 0.0), (30, 40, 8.0), (0, 2, 5.0)]
    scores = PerClientScores(5)
    for c, (correct, total, loss) in enumerate(counts):
        if total:
            scores.update(c, correct, total, loss)
    out = scores.compute()
    with_data = [0.9, 0.25, 0.75, 0.0]  # clients 0, 1, 3, 4
    assert_close_finite(out["acc_mean"], sum(with_data) / 4, rtol=0, atol=1e-12)  # 0.475, not /5 = 0.38
    assert_close_finite(out["acc_weighted"], 40 / 56, rtol=0, atol=1e-12)  # Σ correct / Σ total
    assert_close_finite(out["loss_mean"], (0.3 + 1.5 + 0.2 + 2.5) / 4, rtol=0, atol=1e-12)
    assert_close_finite(out["acc_per_client"][[0, 1, 3, 4]], with_data, rtol=0, atol=1e-12)


# a digits federation where client sizes differ a lot and client 1 has no test data (Dirichlet α = 0.05)
RUN_DATA = {
    "class_path": "datamodules.DigitsDataModule",
    "init_args": {
        "num_clients": 20, "participation": 0.2, "seed": 0,
        "partition": {"class_path": "datamodules.Dirichlet", "init_args": {"alpha": 0.05, "min_samples": 5}},
    },
}  # fmt: skip
ROUNDS, EVAL_EVERY, EVAL_LAST = 10, 3, 4


def read_metrics(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def fedper_run(tmp_path_factory):
    """One tiny train.py run (FedPer, a 16-unit MLP): its run folder."""
    from fl_lightning.cli import train_config

    tmp = tmp_path_factory.mktemp("fedper_run")
    data = tmp / "data.yaml"
    data.write_text(yaml.safe_dump({"data": RUN_DATA}))
    run_dir = tmp / "run"
    overrides = [
        "--model.network.init_args.hidden", "[16]", "--model.lr", "0.05", "--trainer.max_steps", str(ROUNDS),
        "--model.eval_every", str(EVAL_EVERY), "--model.eval_last", str(EVAL_LAST), "--checkpoint_every", str(ROUNDS),
    ]  # fmt: skip
    configs = [ROOT / "configs" / "digits" / "base.yaml", ROOT / "configs" / "digits" / "fedper.yaml", data]
    train_config(configs, overrides, run_dir=run_dir)
    return run_dir


def client_counts(run_dir: Path) -> list[tuple[int, int]]:
    """(correct, total) of every client, computed here: the final global body with the client's own head
    (from the last checkpoint) on the client's own test split, in plain torch."""
    from datamodules import DigitsDataModule, Dirichlet

    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0, partition=Dirichlet(alpha=0.05, min_samples=5))
    dm.setup("fit")
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    body = {n[len("net.") :]: t for n, t in state.items() if n.startswith("net.body.")}
    heads = {n: state["bank." + n.replace(".", "__")] for n in ("head.weight", "head.bias")}
    assert heads["head.weight"].shape == (20, 10, 16)
    counts = []
    for c in range(20):
        x, y = dm.federated.test.client(c)
        h = torch.relu(x.flatten(1) @ body["body.fc1.weight"].T + body["body.fc1.bias"])
        logits = h @ heads["head.weight"][c].T + heads["head.bias"][c]
        counts.append((int((logits.argmax(-1) == y).sum()), len(y)))
    return counts


def test_reported_accuracy_is_the_mean_over_clients_with_test_data(fedper_run):
    """``acc_mean`` (the papers' metric) = mean over clients with test data of correct/total, each client with
    its own model; ``acc_weighted`` = Σ correct / Σ total. Both from counts computed here."""
    counts = client_counts(fedper_run)
    assert any(t == 0 for _, t in counts)  # the definition must say what happens to a client without test data
    acc = [k / t for k, t in counts if t > 0]
    mean, weighted = sum(acc) / len(acc), sum(k for k, _ in counts) / sum(t for _, t in counts)
    assert abs(mean - weighted) > 1e-3 and abs(mean - sum(acc) / len(counts)) > 1e-3  # the definitions differ
    rows = [r for r in read_metrics(fedper_run / "metrics.csv") if "val/acc_mean" in r]
    last = rows[-1]
    assert int(last["step"]) == ROUNDS - 1
    assert_close_finite(last["val/acc_mean"], mean, rtol=0, atol=1e-6)
    assert_close_finite(last["val/acc_weighted"], weighted, rtol=0, atol=1e-6)
    summary = json.loads((fedper_run / "summary.json").read_text())
    assert_close_finite(summary["final"], mean, rtol=0, atol=1e-9)


EVALUATED = [r for r in range(ROUNDS) if (r + 1) % EVAL_EVERY == 0 or r >= ROUNDS - EVAL_LAST]  # 2, 5, 6, 7, 8, 9


def test_summary_last_n_is_the_mean_of_exactly_n_evaluations(fedper_run):
    """``last10`` (the papers' final-rounds average, N = ``eval_last``) is the mean of the last N evaluations.
    With eval_every = 3 and 10 rounds, rounds 2, 5 and the last four (6–9) are evaluated."""
    assert EVALUATED == [2, 5, 6, 7, 8, 9]
    by_round = {int(r["step"]): r for r in read_metrics(fedper_run / "metrics.csv")}
    values = [by_round[r]["val/acc_mean"] for r in EVALUATED]
    last_n = sum(values[-EVAL_LAST:]) / EVAL_LAST
    assert abs(last_n - sum(values[-EVAL_LAST + 1 :]) / (EVAL_LAST - 1)) > 1e-5  # N − 1 would be detectable
    assert abs(last_n - sum(values[-EVAL_LAST - 1 :]) / (EVAL_LAST + 1)) > 1e-5  # and N + 1
    summary = json.loads((fedper_run / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    assert_close_finite(summary["last10"], last_n, rtol=0, atol=1e-6)
    assert_close_finite(by_round[ROUNDS - 1]["val/acc_last10"], last_n, rtol=0, atol=1e-6)
    history = json.loads((fedper_run / "history.json").read_text())
    assert [h["round"] for h in history] == EVALUATED


def test_metrics_csv_has_evaluations_only_at_evaluated_rounds(fedper_run):
    logged = [int(r["step"]) for r in read_metrics(fedper_run / "metrics.csv") if "val/acc_mean" in r]
    assert logged == EVALUATED


def test_communication_bytes_from_parameter_shapes(fedper_run):
    """FedPer on the 64→16→10 MLP uploads and downloads the body only: fc1 = 16·64 + 16 float32 values,
    i.e. 4,160 bytes per client, for the 4 sampled clients (20 clients × participation 0.2)."""
    body_bytes = 4 * (16 * 64 + 16)
    rows = [r for r in read_metrics(fedper_run / "metrics.csv") if "comm/upload_bytes" in r]
    assert len(rows) == ROUNDS
    for r in rows:
        assert r["comm/upload_bytes"] == 4 * body_bytes and r["comm/download_bytes"] == 4 * body_bytes
