"""Each algorithm's client update against a small independent reference written here in plain torch/numpy.

Full-batch local steps (batch size ≥ client samples) make the references independent of the shuffling order.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import nn
from torch.nn import functional as F

import fl_lightning.algorithms as algorithms
from fl_lightning.algorithms import FedAvg, FedPer, FedRep, LGFedAvg, LinearFedRep, LocalOnly
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP, LinearRepresentation

LR, MOMENTUM = 0.05, 0.5


def client_data(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def context(net, x, y, loss=F.cross_entropy):
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, batch_size=10_000)
    return ClientContext(net, 3, x, y, None, opt, loss, make_generator(0, "t", 0, 3))


def params_of(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def reference_sgd(net, x, y, trainable_prefixes, epochs):
    """Plain torch: a model copy, an SGD optimiser over the chosen parameters, ``epochs`` full-batch steps."""
    net = copy.deepcopy(net)
    chosen = [p for n, p in net.named_parameters() if n.startswith(tuple(trainable_prefixes))]
    opt = torch.optim.SGD(chosen, lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return params_of(net)


def assert_params_close(actual, expected, names):
    for n in names:
        assert_close_finite(actual[n], expected[n], rtol=1e-5, atol=1e-6, msg=n)


def with_state(net, state):
    net = copy.deepcopy(net)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n in state:
                p.copy_(state[n])
    return net


@pytest.fixture
def setup():
    torch.manual_seed(0)
    net = DigitsMLP()
    x, y = client_data()
    glob = params_of(net)
    personal_head = {n: v + 0.1 * torch.randn_like(v) for n, v in glob.items() if n.startswith("head.")}
    return net, x, y, glob, personal_head


def test_fedavg_client_update(setup):
    net, x, y, glob, _ = setup
    upd = FedAvg(local_epochs=3).client_update(context(net, x, y), glob, {})
    expected = reference_sgd(net, x, y, [""], 3)
    assert set(upd.upload) == set(glob) and upd.state == {} and upd.num_samples == len(x)
    assert_params_close(upd.upload, expected, glob)


def test_fedrep_client_update_alternates_head_then_body(setup):
    net, x, y, glob, head = setup
    upd = FedRep(head_epochs=4, body_epochs=2).client_update(context(net, x, y), glob, head)
    after_head = reference_sgd(with_state(net, head), x, y, ["head."], 4)  # body frozen
    after_body = reference_sgd(with_state(net, after_head), x, y, ["body."], 2)  # new head frozen
    assert set(upd.upload) == {n for n in glob if n.startswith("body.")}
    assert_params_close(upd.upload, after_body, upd.upload)
    assert_params_close(upd.state, after_head, head)  # the head the body phase saw is the one kept


def test_fedper_client_update_is_joint_with_personal_head(setup):
    net, x, y, glob, head = setup
    upd = FedPer(local_epochs=2).client_update(context(net, x, y), glob, head)
    expected = reference_sgd(with_state(net, head), x, y, [""], 2)
    assert set(upd.upload) == {n for n in glob if n.startswith("body.")}
    assert_params_close({**upd.upload, **upd.state}, expected, glob)


def test_lg_fedavg_keeps_lower_layers_personal(setup):
    net, x, y, glob, _ = setup
    alg = LGFedAvg(local_epochs=2, personal=("body.fc1",))
    personal = {n: v + 0.05 for n, v in glob.items() if n.startswith("body.fc1")}
    upd = alg.client_update(context(net, x, y), glob, personal)
    expected = reference_sgd(with_state(net, personal), x, y, [""], 2)
    assert set(upd.state) == set(personal) and not set(upd.upload) & set(personal)
    assert_params_close({**upd.upload, **upd.state}, expected, glob)


def test_local_only_uploads_nothing(setup):
    net, x, y, glob, _ = setup
    own = {n: v * 0.5 for n, v in glob.items()}
    upd = LocalOnly(local_epochs=2).client_update(context(net, x, y), glob, own)
    assert upd.upload == {}
    assert_params_close(upd.state, reference_sgd(with_state(net, own), x, y, [""], 2), glob)


def linear_setup(m=7, d=6, k=2, seed=1):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(m, d)), rng.normal(size=m)
    b, _ = np.linalg.qr(rng.normal(size=(d, k)))
    w0 = rng.normal(size=k)
    net = LinearRepresentation(d, k)
    glob = {
        "body.weight": torch.tensor(b.T, dtype=torch.float64),
        "head.weight": torch.zeros(1, k, dtype=torch.float64),
    }
    ctx = ClientContext(net, 0, torch.tensor(x), torch.tensor(y), None, ClientOptimizer(), None, make_generator(0))
    return x, y, b, w0, glob, ctx


def test_linear_fedrep_exact_head_and_one_gd_step_on_b():
    x, y, b, w0, glob, ctx = linear_setup()
    eta, m = 0.1, len(y)
    upd = LinearFedRep(body_lr=eta).client_update(ctx, glob, {"head.weight": torch.tensor(w0[None])})
    w = np.linalg.lstsq(x @ b, y, rcond=None)[0]  # argmin_w ½·mean (y − wᵀBᵀx)²
    grad_b = sum((x[j] @ b @ w - y[j]) * np.outer(x[j], w) for j in range(m)) / m
    assert_close_finite(upd.state["head.weight"].numpy().ravel(), w, rtol=1e-8, atol=0.0)
    assert_close_finite(upd.upload["body.weight"].numpy().T, b - eta * grad_b, rtol=1e-8, atol=0.0)


@pytest.mark.parametrize("head_steps", [1, 10])
def test_linear_gd_gd_head_steps(head_steps):
    x, y, b, w0, glob, ctx = linear_setup()
    beta, eta, m = 0.2, 0.1, len(y)
    alg = LinearFedRep(body_lr=eta, head_solver="gd", head_steps=head_steps, head_lr=beta)
    upd = alg.client_update(ctx, glob, {"head.weight": torch.tensor(w0[None])})
    w = w0.copy()
    for _ in range(head_steps):
        w -= beta * sum((w @ b.T @ x[j] - y[j]) * (b.T @ x[j]) for j in range(m)) / m
    grad_b = sum((x[j] @ b @ w - y[j]) * np.outer(x[j], w) for j in range(m)) / m
    assert_close_finite(upd.state["head.weight"].numpy().ravel(), w, rtol=1e-8, atol=0.0)
    assert_close_finite(upd.upload["body.weight"].numpy().T, b - eta * grad_b, rtol=1e-8, atol=0.0)


def test_linear_fedrep_server_orthonormalises_b():
    alg = LinearFedRep()
    bt = torch.randn(2, 6, dtype=torch.float64)
    live = {"body.weight": nn.Parameter(bt.clone())}
    with torch.no_grad():
        alg.server_update(live, {}, 0)
    q = live["body.weight"].detach().T
    assert_close_finite(q.T @ q, torch.eye(2, dtype=torch.float64))
    proj = q @ q.T  # same column span as the averaged B
    assert_close_finite(proj @ bt.T, bt.T)


def test_weight_decay_on_weights_only():
    """decay_bias=False: SGD weight decay 1e-2 on weights, none on biases (plain torch param groups)."""
    torch.manual_seed(0)
    net = DigitsMLP()
    x, y = client_data()
    glob = params_of(net)
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, weight_decay=1e-2, batch_size=10_000, decay_bias=False)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0))
    upd = FedAvg(local_epochs=3).client_update(ctx, glob, {})
    ref = copy.deepcopy(net)
    weights = [p for n, p in ref.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in ref.named_parameters() if n.endswith("bias")]
    sgd = torch.optim.SGD(
        [{"params": weights, "weight_decay": 1e-2}, {"params": biases, "weight_decay": 0.0}], lr=LR, momentum=MOMENTUM
    )
    for _ in range(3):
        sgd.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        sgd.step()
    assert_params_close(upd.upload, params_of(ref), glob)


# ---- FedMD Phase 1 against numpy ------------------------------------------------------------------------------
def numpy_fedmd_phase1(xs, ys, anchor_ids, theta0, k, iters, step_scale=0.5):
    """Spec 001 §2.1 written out in numpy with explicit loops over point pairs: per iteration, for every anchor
    model θ_h, Y_h = Σ_clients Σ_{a≠b} e_a e_bᵀ with e = (y − xᵀθ_h)x, Û_h = its top-k left singular vectors;
    then anchor h (client anchor_ids[h]) forms A = Σ_{a≠b} (Ûᵀe_a)(Ûᵀe_b)ᵀ / (n(n−1)) on its own points,
    σ̂ = √σ₁(A), β̂ = the top left singular vector, Ûβ̂ oriented along Σ e, and moves θ_h += step_scale·σ̂·Ûβ̂.
    Finally single linkage merges the closest anchor groups until k remain; the group means are returned."""

    def residuals(x, y, theta):
        return (y - x @ theta)[:, None] * x

    def pair_sum(rows):
        total = np.zeros((rows.shape[1], rows.shape[1]))
        for a in range(len(rows)):
            for b in range(len(rows)):
                if a != b:
                    total += np.outer(rows[a], rows[b])
        return total

    models = np.repeat(theta0[None], len(anchor_ids), axis=0)
    for _ in range(iters):
        bases = []
        for theta in models:
            y_h = sum(pair_sum(residuals(x, y, theta)) for x, y in zip(xs, ys))
            bases.append(np.linalg.svd(y_h)[0][:, :k])
        new = models.copy()
        for h, (client, theta, basis) in enumerate(zip(anchor_ids, models, bases)):
            e = residuals(xs[client], ys[client], theta)
            n = len(e)
            a = pair_sum(e @ basis) / (n * (n - 1))
            u, s, _ = np.linalg.svd(a)
            direction = basis @ u[:, 0]
            if direction @ e.sum(0) < 0:
                direction = -direction
            new[h] = theta + step_scale * np.sqrt(s[0]) * direction
        models = new
    groups = [[h] for h in range(len(models))]
    while len(groups) > k:  # single linkage: merge the two groups with the closest members
        pairs = [(i, j) for i in range(len(groups)) for j in range(i + 1, len(groups))]
        i, j = min(
            pairs,
            key=lambda p: min(np.linalg.norm(models[a] - models[b]) for a in groups[p[0]] for b in groups[p[1]]),
        )
        groups[i] += groups.pop(j)
    return models, np.stack([models[g].mean(0) for g in groups])


def test_fedmd_phase1_in_the_engine_matches_a_numpy_implementation():
    from conftest import fit

    from datamodules import MixedRegressionDataModule
    from fl_lightning.algorithms import FedMD
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import ClusteredLinear

    sizes = [4] * 24 + [20] * 8
    dm = MixedRegressionDataModule(sizes=sizes, probs=[0.5, 0.5], dim=6, noise=0.1, seed=0)
    algo = FedMD(num_anchors=3, phase1_iters=2, subspace="svd", anchor_min_samples=20, seed=0)
    module = FederatedModule(algo, ClusteredLinear(2, 6, seed=1), aggregation="num_samples", eval_every=1000)
    theta0 = module.net.theta.detach()[0].numpy().copy()
    fit(module, dm, algo.warmup_rounds)  # registration + 2 × (subspace, anchor): Phase 1 only
    train = dm.federated.train
    xs = [train.client(c)[0].double().numpy() for c in range(train.num_clients)]
    ys = [train.client(c)[1].double().numpy() for c in range(train.num_clients)]
    anchors = algo.anchor_ids.tolist()
    assert len(set(anchors)) == 3 and all(len(xs[c]) >= 20 for c in anchors)  # drawn among the eligible clients
    models, centres = numpy_fedmd_phase1(xs, ys, anchors, theta0, k=2, iters=2)
    assert np.isfinite(models).all() and np.abs(models - theta0).max() > 1e-2  # the anchors moved
    assert_close_finite(algo.anchor_models.numpy(), models, rtol=1e-8, atol=1e-10)
    got = module.net.theta.detach().numpy()
    order = lambda m: m[np.lexsort(m.T[::-1])]  # noqa: E731 (group labels may be numbered differently)
    assert_close_finite(order(got), order(centres), rtol=1e-8, atol=1e-10)


# ---- frozen parameters ------------------------------------------------------------------------------------------
NEURAL = {
    "FedAvg": lambda: FedAvg(1),
    "FedAvgSteps": lambda: algorithms.FedAvgSteps(5),
    "FedProx": lambda: algorithms.FedProx(0.1),
    "SCAFFOLD": lambda: algorithms.SCAFFOLD(),
    "FedMTL": lambda: algorithms.FedMTL(),
    "PerFedAvg": lambda: algorithms.PerFedAvg(),
    "LGFedAvg": lambda: LGFedAvg(1, personal=("body.fc2.",)),
    "L2GD": lambda: algorithms.L2GD(p=0.5),
    "APFL": lambda: algorithms.APFL(),
    "Ditto": lambda: algorithms.Ditto(),
    "FedPer": lambda: FedPer(1),
    "FedRep": lambda: FedRep(2, 1),
    "LocalOnly": lambda: LocalOnly(1),
    "FedBN": lambda: algorithms.FedBN(),  # on DigitsCNN with BatchNorm (NETWORKS)
    "FedBABU": lambda: algorithms.FedBABU(),
    "FedRoD": lambda: algorithms.FedRoD(),
    "FedALA": lambda: algorithms.FedALA(),
    "PFedMe": lambda: algorithms.PFedMe(inner_steps=2, local_steps=3),
    "FedProto": lambda: algorithms.FedProto(),
    "MOON": lambda: algorithms.MOON(),
    "FedDyn": lambda: algorithms.FedDyn(),
}
NETWORKS = {"FedBN": lambda: DigitsCNN(batchnorm=True)}  # others: DigitsMLP(hidden=(16, 8)); both have body.fc1
CLOSED_FORM = [
    "LinearFedAvg",
    "LinearFedRep",
    "IFCA",
    "FedMD",
    "OneShotClustering",
    "PowerInitLocalGD",
    "AlternatingGD",
]


def test_every_algorithm_is_checked_with_a_frozen_layer():
    exported = {n for n in algorithms.__all__ if n not in ("Algorithm", "ClientUpdate")}
    assert exported == set(NEURAL) | set(CLOSED_FORM)


def observed_fit(module, dm, rounds):
    from conftest import fit

    seen: set[str] = set()
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.update(t))

    module.attach_data = attach_and_observe
    fit(module, dm, rounds)
    return seen


@pytest.mark.parametrize("name", sorted(NEURAL))
def test_a_frozen_layer_stays_frozen_in_every_gradient_algorithm(name):
    """``body.fc1`` frozen: the run works, the layer never changes, is never uploaded nor kept per client."""
    from datamodules import DigitsDataModule, Shards
    from fl_lightning.engine.module import FederatedModule

    torch.manual_seed(0)
    net = NETWORKS.get(name, lambda: DigitsMLP(hidden=(16, 8)))()
    net.body.fc1.requires_grad_(False)
    before = params_of(net)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    module = FederatedModule(NEURAL[name](), net, aggregation="uniform", eval_every=100, eval_last=1)
    seen = observed_fit(module, dm, 2)
    frozen = {"body.fc1.weight", "body.fc1.bias"}
    assert 0 <= module.summary["final"] <= 1
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters() if n in frozen)
    assert not seen & frozen and not any(n.endswith(tuple(frozen)) for n in module.bank.names)
    trained_global = any(not torch.equal(p, before[n]) for n, p in net.named_parameters() if n not in frozen)
    assert trained_global or name in ("LocalOnly", "FedProto")  # FedProto uploads prototypes, never parameters
    if name != "LocalOnly":
        assert seen


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_closed_form_algorithms_refuse_a_frozen_parameter_in_one_line(name):
    algorithm = getattr(algorithms, name)()
    with pytest.raises(ConfigError, match=f"{name} updates its parameters in closed form.*body.weight"):
        algorithm.set_frozen(["body.weight"])
    algorithm.set_frozen([])  # nothing frozen: fine


class MeanOfTokens(nn.Module):
    def forward(self, e):
        return e.mean(1)


def token_datamodule(num_clients=4, train=12, test=6, vocab=30, length=5):
    from datamodules.base import FederatedDataModule
    from fl_lightning.engine.client_data import ClientSplit, FederatedData

    g = torch.Generator().manual_seed(0)

    def split(per_client):
        n = num_clients * per_client
        x = torch.randint(0, vocab, (n, length), generator=g)
        y = (x[:, 0] < vocab // 2).long()  # learnable from the first token
        return ClientSplit(x, y, torch.arange(0, n + 1, per_client))

    class Tokens(FederatedDataModule):
        def build(self):
            return FederatedData(split(train), split(test), 2, seed=0)

    return Tokens(num_clients=num_clients, clients_per_round=2, seed=0)


@pytest.mark.parametrize("name", ["Ditto", "APFL", "PerFedAvg"])
def test_ditto_apfl_perfedavg_run_with_a_frozen_embedding(name):
    """The Sent140 setting in small: a frozen (pretrained) embedding under a trainable body and head."""
    from collections import OrderedDict

    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models.split import SplitModel

    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(embed=nn.Embedding(30, 6), pool=MeanOfTokens(), fc=nn.Linear(6, 8), act=nn.Tanh()))
    net = SplitModel(body, nn.Linear(8, 2))
    net.body.embed.weight.requires_grad_(False)
    before = params_of(net)
    module = FederatedModule(NEURAL[name](), net, batch_size=4, eval_every=100, eval_last=1)
    seen = observed_fit(module, token_datamodule(), 3)
    assert torch.equal(net.body.embed.weight, before["body.embed.weight"])
    assert "body.embed.weight" not in seen and seen == {n for n in before if n != "body.embed.weight"}
    assert not any("embed" in n for n in module.bank.names)
    assert not torch.equal(net.body.fc.weight, before["body.fc.weight"]) and 0 <= module.summary["final"] <= 1
