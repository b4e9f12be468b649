"""pFedMe, FedProto, MOON and FedDyn (issue 17) against plain-torch references written here, over several rounds.

Each reference test runs the engine (``FederatedModule`` on the bundled digits, 4 clients, 3 sampled per round,
full-batch local steps so that the order of a client's samples does not matter, momentum 0.5) and replays the same
cohorts with an independent implementation: model copies, ``torch.optim.SGD`` and the paper's equations. Each also
replays a reference with one role swapped (the mistake a careless implementation would make) and requires it to
differ, so the comparison can fail.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import fit
from helpers import assert_close_finite
from torch.nn import functional as F

from datamodules import DigitsDataModule, Dirichlet, Shards
from fl_lightning.algorithms import MOON, FedDyn, FedProto, PFedMe
from fl_lightning.cli import main, train_config
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import make_generator
from fl_lightning.models import DigitsMLP

LR, MOMENTUM, ROUNDS = 0.05, 0.5, 3
FULL_BATCH = 10_000


# ---- the engine side: a short run that records its cohorts ---------------------------------------------------
def params_of(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def model_with(template, params):
    net = copy.deepcopy(template)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(params[n])
    return net


class Run:
    """An engine run of ``algorithm`` on 4 digits clients; ``cohorts`` lists the clients of every round."""

    def __init__(self, algorithm, aggregation="uniform", server_lr=1.0, rounds=ROUNDS, **module_kwargs):
        torch.manual_seed(0)
        net = DigitsMLP(hidden=(16, 8))
        self.template, self.init = copy.deepcopy(net), params_of(net)
        self.module = FederatedModule(
            algorithm, net, lr=LR, momentum=MOMENTUM, batch_size=FULL_BATCH, aggregation=aggregation,
            server_lr=server_lr, eval_every=100, eval_last=1, **module_kwargs,
        )  # fmt: skip
        self.cohorts: list[list[int]] = []
        original = self.module.run_clients

        def recording(clients, round_idx, glob, states, budgets):
            self.cohorts.append(list(clients))
            return original(clients, round_idx, glob, states, budgets)

        self.module.run_clients = recording
        dm = DigitsDataModule(num_clients=4, partition=Dirichlet(1.0, min_samples=30), clients_per_round=3, seed=0)
        fit(self.module, dm, rounds)
        self.data = [self.module.fed.train.client(c) for c in range(4)]
        assert len(self.cohorts) == rounds and any(set(a) & set(b) for a, b in zip(self.cohorts, self.cohorts[1:]))

    def global_params(self):
        return {n: p.detach() for n, p in self.module.net.named_parameters()}

    def bank(self, prefix, client):
        row = self.module.bank.get(client)
        return {n[len(prefix) :]: v for n, v in row.items() if n.startswith(prefix)}


def assert_matches(actual, expected, names, tol=2e-4):
    for n in names:
        assert_close_finite(actual[n], expected[n], rtol=tol, atol=tol * 0.1, msg=n)


def max_difference(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in b)


def mean_of(dicts, weights=None):
    weights = weights or [1.0] * len(dicts)
    return {n: sum(w * d[n] for w, d in zip(weights, dicts)) / sum(weights) for n in dicts[0]}


# ---- pFedMe ------------------------------------------------------------------------------------------------------
def pfedme_client(template, w0, x, y, lam, personal_lr, inner, local, swap=False):
    """Algorithm 1: R times (K GD steps of f(θ) + λ/2‖θ − w‖² at the personal lr; SGD step on w with gradient
    λ(w − θ)). Returns (local model w, personal model θ); ``swap`` returns them the other way round."""
    local_model, personal = model_with(template, w0), model_with(template, w0)
    opt = torch.optim.SGD(local_model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(local):
        for _ in range(inner):
            prox = sum(((p - q.detach()) ** 2).sum() for p, q in zip(personal.parameters(), local_model.parameters()))
            loss = F.cross_entropy(personal(x), y) + lam / 2 * prox
            grads = torch.autograd.grad(loss, list(personal.parameters()))
            with torch.no_grad():
                for p, g in zip(personal.parameters(), grads):
                    p -= personal_lr * g
        opt.zero_grad()
        for p, q in zip(local_model.parameters(), personal.parameters()):
            p.grad = lam * (p.detach() - q.detach())
        opt.step()
    w, theta = params_of(local_model), params_of(personal)
    return (theta, w) if swap else (w, theta)


def pfedme_reference(run, lam, personal_lr, inner, local, beta, swap=False):
    w, theta = dict(run.init), {c: dict(run.init) for c in range(4)}
    for cohort in run.cohorts:
        uploads = []
        for c in cohort:
            w_c, theta[c] = pfedme_client(run.template, w, *run.data[c], lam, personal_lr, inner, local, swap)
            uploads.append(w_c)
        mean = mean_of(uploads)
        w = {n: (1 - beta) * w[n] + beta * mean[n] for n in w}  # β-mixing
    return w, theta


def test_pfedme_client_and_server_updates_match_the_reference_over_rounds():
    lam, personal_lr, inner, local, beta = 15.0, 0.02, 3, 4, 0.7
    run = Run(PFedMe(lam=lam, personal_lr=personal_lr, inner_steps=inner, local_steps=local), server_lr=beta)
    w, theta = pfedme_reference(run, lam, personal_lr, inner, local, beta)
    assert max_difference(w, run.init) > 1e-3
    assert_matches(run.global_params(), w, w)
    for c in range(4):  # θ_i of every client (the unsampled ones keep theirs), evaluated with
        assert_matches(run.bank("theta.", c), theta[c], w)
    swapped, _ = pfedme_reference(run, lam, personal_lr, inner, local, beta, swap=True)  # uploading θ, keeping w
    assert max_difference(run.global_params(), swapped) > 1e-3


# ---- MOON --------------------------------------------------------------------------------------------------------
def moon_client(template, glob, prev, x, y, mu, tau, epochs, swap=False):
    """Eq. 4: CE + μ·(−log e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ})), z = body(x)."""
    model, global_model, previous = (model_with(template, p) for p in (glob, glob, prev))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        z = model.body(x)
        with torch.no_grad():
            z_glob, z_prev = global_model.body(x), previous.body(x)
        if swap:
            z_glob, z_prev = z_prev, z_glob
        pos = torch.exp(F.cosine_similarity(z, z_glob) / tau)
        neg = torch.exp(F.cosine_similarity(z, z_prev) / tau)
        loss = F.cross_entropy(model.head(z), y) + mu * (-torch.log(pos / (pos + neg))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params_of(model)


def moon_reference(run, mu, tau, epochs, swap=False):
    w, prev = dict(run.init), {c: dict(run.init) for c in range(4)}
    for cohort in run.cohorts:
        uploads = []
        for c in cohort:
            prev[c] = moon_client(run.template, w, prev[c], *run.data[c], mu, tau, epochs, swap)
            uploads.append(prev[c])
        w = mean_of(uploads, [float(len(run.data[c][1])) for c in cohort])  # FedAvg, weighted by client size
    return w, prev


def test_moon_client_update_matches_the_reference_over_rounds():
    mu, tau, epochs = 5.0, 0.5, 3
    run = Run(MOON(mu=mu, temperature=tau, local_epochs=epochs), aggregation="num_samples")
    w, prev = moon_reference(run, mu, tau, epochs)
    assert_matches(run.global_params(), w, w)
    for c in range(4):
        assert_matches(run.bank("prev.", c), prev[c], w)
    swapped, _ = moon_reference(run, mu, tau, epochs, swap=True)  # positive and negative pairs swapped
    assert max_difference(run.global_params(), swapped) > 1e-4


def test_moon_without_the_contrastive_term_is_fedavg():
    from fl_lightning.algorithms import FedAvg

    moon = Run(MOON(mu=0.0, local_epochs=2), aggregation="num_samples")
    fedavg = Run(FedAvg(local_epochs=2), aggregation="num_samples")
    assert moon.cohorts == fedavg.cohorts
    assert_matches(moon.global_params(), fedavg.global_params(), moon.init, tol=1e-6)


# ---- FedDyn -----------------------------------------------------------------------------------------------------
def feddyn_client(template, theta, g, x, y, alpha, epochs, sign=-1.0):
    """argmin L_i(θ) − ⟨g_i, θ⟩ + α/2‖θ − θ^{t−1}‖² by SGD (``sign=+1``: the linear term's sign flipped)."""
    model = model_with(template, theta)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        loss = F.cross_entropy(model(x), y)
        for n, p in model.named_parameters():
            loss = loss + sign * (g[n] * p).sum() + alpha / 2 * ((p - theta[n]) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return params_of(model)


def feddyn_reference(run, alpha, epochs, sign=-1.0):
    m = 4
    theta = dict(run.init)
    h = {n: torch.zeros_like(v) for n, v in theta.items()}
    g = {c: {n: torch.zeros_like(v) for n, v in theta.items()} for c in range(m)}
    for cohort in run.cohorts:
        local = {c: feddyn_client(run.template, theta, g[c], *run.data[c], alpha, epochs, sign) for c in cohort}
        for c in cohort:
            g[c] = {n: g[c][n] - alpha * (local[c][n] - theta[n]) for n in theta}
        h = {n: h[n] - alpha / m * sum(local[c][n] - theta[n] for c in cohort) for n in theta}
        mean = mean_of([local[c] for c in cohort])
        theta = {n: mean[n] - h[n] / alpha for n in theta}
    return theta, g, h


def test_feddyn_client_and_server_updates_match_the_reference_over_rounds():
    alpha, epochs = 0.1, 3
    run = Run(FedDyn(alpha=alpha, local_epochs=epochs))
    theta, g, h = feddyn_reference(run, alpha, epochs)
    assert max(float(v.abs().max()) for v in h.values()) > 1e-4  # the server state is in play
    assert_matches(run.global_params(), theta, theta)
    assert_matches(run.module.algorithm.server_state(), h, h)
    for c in range(4):
        assert_matches(run.bank("grad.", c), g[c], theta)
    flipped, _, _ = feddyn_reference(run, alpha, epochs, sign=+1.0)  # +⟨g_i, θ⟩ instead of −⟨g_i, θ⟩
    assert max_difference(run.global_params(), flipped) > 1e-4


# ---- FedProto ----------------------------------------------------------------------------------------------------
def fedproto_train(model, x, y, prototypes, known, lam, epochs):
    """CE + λ·mean_{b,k} (φ(x_b) − C̄^(y_b))²_k (nn.MSELoss; zero for samples whose class has no global prototype)
    by SGD, in place."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for _ in range(epochs):
        z = model.body(x)
        distance = ((z - prototypes[y]) ** 2).mean(1) * known[y].float()
        loss = F.cross_entropy(model.head(z), y) + lam * distance.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def fedproto_reference(run, lam, epochs, count_weighted=True):
    classes, dim = 10, 8
    prototypes, known = torch.zeros(classes, dim), torch.zeros(classes, dtype=torch.bool)
    models = {c: model_with(run.template, run.init) for c in range(4)}
    for cohort in run.cohorts:
        local = []  # (prototypes, counts) per client
        for c in cohort:
            x, y = run.data[c]
            fedproto_train(models[c], x, y, prototypes, known, lam, epochs)
            with torch.no_grad():
                z = models[c].body(x)
            counts = torch.tensor([float((y == j).sum()) for j in range(classes)])
            means = torch.stack([z[y == j].mean(0) if counts[j] else torch.zeros(dim) for j in range(classes)])
            local.append((means, counts))
        for j in range(classes):
            holders = [(p[j], n[j]) for p, n in local if n[j] > 0]
            if holders:
                weights = [float(n) if count_weighted else 1.0 for _, n in holders]
                prototypes[j] = sum(w * p for w, (p, _) in zip(weights, holders)) / sum(weights)
                known[j] = True
    return models, prototypes, known


def nearest_prototype_accuracy(model, x, y, prototypes, known):
    with torch.no_grad():
        d = torch.cdist(model.body(x), prototypes)
    d[:, ~known] = math.inf
    return float((d.argmin(1) == y).float().mean())


def test_fedproto_matches_the_reference_and_predicts_by_the_nearest_global_prototype():
    lam, epochs = 0.5, 3
    run = Run(FedProto(lam=lam, local_epochs=epochs))
    models, prototypes, known = fedproto_reference(run, lam, epochs)
    alg = run.module.algorithm
    assert bool(known.any()) and torch.equal(alg.known, known)
    assert_close_finite(alg.global_prototypes[known], prototypes[known], rtol=2e-4, atol=2e-5)
    for c in range(4):
        assert_matches(run.module.bank.get(c), params_of(models[c]), run.init)
    assert all(torch.equal(p, run.init[n]) for n, p in run.global_params().items())  # no parameter is averaged
    scores = run.module.evaluate_clients(ROUNDS - 1)
    test = run.module.fed.test
    expected = [nearest_prototype_accuracy(models[c], *test.client(c), prototypes, known) for c in range(4)]
    assert_close_finite(scores["acc_per_client"], torch.tensor(expected), atol=1e-6)
    _, unweighted, _ = fedproto_reference(run, lam, epochs, count_weighted=False)  # prototypes not count-weighted
    assert float((alg.global_prototypes[known] - unweighted[known]).abs().max()) > 1e-4


def test_fedproto_uploads_only_prototypes_and_the_label_histogram(monkeypatch):
    """What crosses the boundary, as the ledger sees it: per-class feature sums [classes, features] and per-class
    counts equal to the client's label histogram; the ledger counts only the sums as state-dependent bytes."""
    from fl_lightning.engine.ledger import CommunicationLedger

    seen = []
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda led, r, c, t: seen.append((c, dict(t)))])
    run = Run(FedProto(lam=0.5, local_epochs=1), rounds=2)
    assert len(seen) == sum(len(c) for c in run.cohorts)
    for client, upload in seen:
        assert set(upload) == {"class_feature_sums", "class_counts"}
        assert upload["class_feature_sums"].shape == (10, 8)
        assert torch.equal(upload["class_counts"], torch.bincount(run.data[client][1], minlength=10).float())
    last = run.module.ledger.history[-1]
    assert last.state_dependent_bytes == last.uploads * 10 * 8 * 4 and last.bytes == last.uploads * (10 * 8 + 10) * 4
    assert run.module.ledger.describe().startswith("per-class prototypes")


def test_fedproto_finetune_trains_on_the_local_loss_with_the_global_prototypes():
    """"+FT" and new clients: the chosen parameters train on CE + λ‖φ − C̄‖² (here the whole model, full batch)."""
    torch.manual_seed(1)
    net = DigitsMLP(hidden=(16, 8))
    alg = FedProto(lam=2.0)
    alg.check_compatible(net, 10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 1, 8, 8, generator=g), torch.randint(0, 4, (40,), generator=g)
    alg.global_prototypes.copy_(torch.rand(10, 8, generator=g))
    alg.prototype_counts[:3] = 5.0  # classes 0-2 have a prototype, class 3 has none
    opt = ClientOptimizer(lr=LR, momentum=MOMENTUM, batch_size=FULL_BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "t", 0, 0))
    tuned = alg.finetune(ctx, params_of(net), 4, ("",))
    expected = fedproto_train(copy.deepcopy(net), x, y, alg.global_prototypes, alg.known, 2.0, 4)
    assert_matches(tuned, params_of(expected), tuned)
    head_only = alg.finetune(ctx, params_of(net), 4, ("head.",))
    assert all(torch.equal(head_only[n], p) for n, p in params_of(net).items() if n.startswith("body."))


# ---- held-out new clients ---------------------------------------------------------------------------------------
class WithNewClients(DigitsDataModule):
    def setup(self, stage=None):
        super().setup(stage)
        other = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
        other.setup()
        self.new_clients = other.federated


@pytest.mark.parametrize("name", ["PFedMe", "FedProto"])
def test_new_clients_are_evaluated_through_the_held_out_client_path(name):
    algorithm = PFedMe(inner_steps=2, local_steps=3) if name == "PFedMe" else FedProto()
    finetune = FineTune(epochs=3, prefixes=("",) if name == "FedProto" else ("head.",))
    module = FederatedModule(
        algorithm, DigitsMLP(hidden=(16, 8)), lr=LR, momentum=MOMENTUM, batch_size=FULL_BATCH,
        aggregation="uniform", eval_every=100, eval_last=1, new_client_finetune=finetune,
    )  # fmt: skip
    fit(module, WithNewClients(num_clients=10, partition=Shards(2), clients_per_round=4, seed=0), rounds=3)
    acc = module.summary["new_clients_acc"]
    assert 0.0 <= acc <= 1.0 and module.bank.num_clients == 10
    if name == "FedProto":  # each new client: the fresh model trained on the local loss, nearest prototype
        new = WithNewClients(num_clients=10, partition=Shards(2), seed=0)
        new.setup()
        init = params_of(module.net)  # FedProto never moves the global model: it is the initial one
        proto, known = algorithm.global_prototypes, algorithm.known
        accs = []
        for c in range(5):
            x, y = new.new_clients.train.client(c)
            model = fedproto_train(model_with(module.net, init), x, y, proto, known, algorithm.lam, 3)
            accs.append(nearest_prototype_accuracy(model, *new.new_clients.test.client(c), proto, known))
        assert abs(acc - sum(accs) / 5) < 1e-5


# ---- the digits configs, both executors -------------------------------------------------------------------------
DIGITS = ["configs/digits/base.yaml"]
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
    assert "falls back to 'sequential'" in caplog.text  # none of the four is vectorizable (logged)


@pytest.mark.parametrize(
    "column",
    ["cifar10_100x2", "cifar10_100x5", "cifar10_1000x2", "cifar100_100x5", "cifar100_100x20", "sent140_183x2",
     "femnist_150x3"],
)  # fmt: skip
def test_method_configs_run_on_every_table1_column(column, tmp_path):
    from data_fixtures import make_fixture

    fixture = make_fixture(column, tmp_path)
    for method in ("pfedme", "fedproto", "moon", "feddyn"):
        cheap = ["--model.algorithm.init_args.inner_steps", "1", "--model.algorithm.init_args.local_steps", "2"]
        summary = train_config(
            [f"configs/table1/{column}.yaml", f"configs/methods/{method}.yaml"],
            [*fixture, *(cheap if method == "pfedme" else []), "--trainer.max_steps=1", "--trainer.logger=false",
             "--trainer.enable_checkpointing=false", "--model.eval_last=1"],
            run_dir=tmp_path / method,
        )  # fmt: skip
        assert summary["rounds"] == 1 and 0.0 <= summary["last10"] <= 1.0, (column, method)


# ---- bad input: one line, exit code 2 ---------------------------------------------------------------------------
REGRESSION = ["--config", "configs/mixed_regression/c1.yaml"]
DIGITS_RUN = ["--config", "configs/digits/base.yaml"]
BAD = {
    "FedProto on regression": (
        [*REGRESSION, "--model.algorithm", "fl_lightning.algorithms.FedProto"],
        "FedProto needs a classification task",
    ),
    "MOON without a body": ([*REGRESSION, "--model.algorithm", "fl_lightning.algorithms.MOON"], "MOON needs a network"),
    "FedProto with a side branch": (
        ["--config", "configs/perfedsi/digits.yaml", "--config", "configs/perfedsi/perfedsi_concat.yaml",
         "--model.algorithm", "fl_lightning.algorithms.FedProto", "--model.aggregation", "uniform"],
        "FedProto needs a network without a side-information branch",
    ),  # fmt: skip
    "FedDyn weighted": (
        [*DIGITS_RUN, "--config", "configs/digits/feddyn.yaml", "--model.aggregation", "num_samples"],
        "FedDyn needs model.aggregation: uniform",
    ),
    "FedProto weighted": (
        [*DIGITS_RUN, "--config", "configs/digits/fedproto.yaml", "--model.aggregation", "num_samples"],
        "FedProto needs model.aggregation: uniform",
    ),
    "pFedMe negative lambda": (
        [*DIGITS_RUN, "--config", "configs/digits/pfedme.yaml", "--model.algorithm.init_args.lam", "-1"],
        "PFedMe needs lam > 0",
    ),
    "MOON zero temperature": (
        [*DIGITS_RUN, "--config", "configs/digits/moon.yaml", "--model.algorithm.init_args.temperature", "0"],
        "MOON needs mu ≥ 0 and temperature > 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unusable_combinations_stop_before_training_with_one_line(case, tmp_path, capsys):
    args, expected = BAD[case]
    code = main([*args, "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false", "--run_dir",
                 str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and expected in errors[0], err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


# ---- server state in checkpoints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedproto", "feddyn"])
def test_resume_restores_the_server_state(method, tmp_path):
    """FedProto's global prototypes and FedDyn's h are module buffers: stopping after round 3 and resuming gives
    the uninterrupted run's result."""
    configs = [*DIGITS, f"configs/digits/{method}.yaml"]
    short = ["--model.eval_every", "100", "--model.eval_last", "1"]
    straight = train_config(configs, [*short, "--trainer.max_steps", "6"], run_dir=tmp_path / "a")
    train_config(configs, [*short, "--trainer.max_steps", "3"], run_dir=tmp_path / "b")
    resumed = train_config(configs, [*short, "--trainer.max_steps", "6", "--ckpt_path", "last"], run_dir=tmp_path / "b")
    assert resumed["rounds"] == straight["rounds"] == 6 and resumed["final"] == straight["final"]
