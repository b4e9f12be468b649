"""FedProto (Tan et al. 2022; ``fl_lightning/algorithms/fedproto.py``) against references written here: its arguments
and defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedProto
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.body_head_network import BodyHead, C, D, H, inputs, np_features, np_head, weights
from tests.helpers.clients import client_context
from tests.helpers.round_references import (
    FULL_BATCH,
    LR,
    MOMENTUM,
    ROUNDS,
    Run,
    assert_matches,
    fedproto_train,
    model_with,
    nearest_prototype_accuracy,
    params_of,
)


def fedproto_reference(run, lam, epochs, count_weighted=True):
    classes, dim = 10, 8
    prototypes, known = torch.zeros(classes, dim), torch.zeros(classes, dtype=torch.bool)
    models = {c: model_with(run.template, run.init) for c in range(4)}
    for cohort in run.cohorts:
        local = []  # (prototypes, counts) per client
        for c in cohort:
            x, y = run.data[c]
            seen = []
            fedproto_train(models[c], x, y, prototypes, known, lam, epochs, seen)
            z = seen[-1]  # the prototypes: features of the last epoch's training pass (Algorithm 1)
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


@pytest.mark.parametrize("weighting", ["client", "count"])
def test_fedproto_matches_the_reference_and_predicts_by_the_nearest_global_prototype(weighting: str):
    """Default ``weighting: client``: each holder's prototype weighs the same (the authors' ``proto_aggregation``);
    ``count``: weighted by its class counts. The other weighting's prototypes differ (the clients' counts differ)."""
    lam, epochs = 0.5, 3
    default = FedProto(lam=lam, local_epochs=epochs)  # weighting: client
    algorithm = default if weighting == "client" else FedProto(lam, epochs, weighting=weighting)  # type: ignore[arg-type]
    run = Run(algorithm)
    models, prototypes, known = fedproto_reference(run, lam, epochs, count_weighted=weighting == "count")
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
    _, other, _ = fedproto_reference(run, lam, epochs, count_weighted=weighting != "count")  # the other weighting
    assert float((alg.global_prototypes[known] - other[known]).abs().max()) > 1e-4


@pytest.mark.parametrize("weighting", ["client", "count"])
def test_fedproto_uploads_only_prototypes_and_the_held_classes_or_the_label_histogram(monkeypatch, weighting: str):
    """What crosses the boundary, as the ledger sees it: per-class feature sums [classes, features] and per-class
    weights: a 0/1 flag per held class (``client``, the sums are then the prototypes) or the client's label
    histogram (``count``); the ledger counts only the sums as state-dependent bytes."""
    from fl_lightning.engine.aggregation import CommunicationLedger

    seen = []
    monkeypatch.setattr(CommunicationLedger, "global_observers", [lambda led, r, c, t: seen.append((c, dict(t)))])
    run = Run(FedProto(lam=0.5, local_epochs=1, weighting=weighting), rounds=2)  # type: ignore[arg-type]
    assert len(seen) == sum(len(c) for c in run.cohorts)
    for client, upload in seen:
        assert set(upload) == {"class_feature_sums", "class_counts"}
        assert upload["class_feature_sums"].shape == (10, 8)
        histogram = torch.bincount(run.data[client][1], minlength=10).float()
        expected = histogram if weighting == "count" else (histogram > 0).float()
        assert torch.equal(upload["class_counts"], expected)
        assert bool((upload["class_feature_sums"][histogram == 0] == 0).all())
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
    ctx = client_context(net, x, y, optimizer=opt, loss=F.cross_entropy, generator=make_generator(0, "t", 0, 0))
    tuned = alg.finetune(ctx, params_of(net), 4, ("",))
    expected = fedproto_train(copy.deepcopy(net), x, y, alg.global_prototypes, alg.known, 2.0, 4)
    assert_matches(tuned, params_of(expected), tuned)
    head_only = alg.finetune(ctx, params_of(net), 4, ("head.",))
    assert all(torch.equal(head_only[n], p) for n, p in params_of(net).items() if n.startswith("body."))


SIDE_SCALE = 2.0


class ShiftSide(nn.Module):
    """``z + scale · s`` with a fixed buffer ``scale`` (left out of the parameters given to ``predict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(SIDE_SCALE, dtype=torch.float64))

    def forward(self, z: Tensor, s: Tensor) -> Tensor:
        return z + self.scale * s


def network(side: bool) -> SplitModel:
    return SplitModel(nn.Linear(D, H), nn.Linear(H, C), ShiftSide() if side else None).double()


PROTOS = np.array([[1.0, -0.5], [0.3, 0.2], [-1.0, 2.0]])


def with_prototypes(counts: list[float], **kw: object) -> FedProto:
    alg = FedProto(**kw)  # type: ignore[arg-type]
    alg.global_prototypes = torch.tensor(PROTOS, dtype=torch.float64)
    alg.prototype_counts = torch.tensor(counts, dtype=torch.float64)
    return alg


def test_prototype_logits_are_negative_squared_distances_with_a_floor_for_unknown_classes() -> None:
    p, (x, _) = weights(), inputs()
    alg = with_prototypes([2.0, 0.0, 5.0])  # class 1 has no global prototype
    got = alg.predict(network(False), p, x, None)
    f = np_features(p, x)
    sq = ((f[:, None, :] - PROTOS[None, :, :]) ** 2).sum(-1)  # [n, C]
    want = -sq
    floor = np.minimum(want[:, 0], want[:, 2]) - 1.0
    want[:, 1] = floor
    assert_close_finite(got, want)
    assert (got.argmax(1).numpy() != 1).all()


def test_head_inference_is_the_forward_with_side_information_and_module_buffers() -> None:
    p, (x, _) = weights(), inputs()
    side = torch.tensor([[0.5, -1.0], [1.0, 0.0], [-2.0, 0.25], [0.0, 3.0]], dtype=torch.float64)
    want = np_head(p, np_features(p, x) + SIDE_SCALE * side.numpy())  # the "side.scale" buffer is not in p
    alg = with_prototypes([1.0, 1.0, 1.0], inference="head")  # prototypes exist but are not used
    assert_close_finite(alg.predict(network(True), p, x, side), want)


def test_prototype_inference_before_any_prototype_uses_the_head() -> None:
    p, (x, _) = weights(), inputs()
    side = torch.tensor([[1.0, 2.0]], dtype=torch.float64).expand(4, 2)
    want = np_head(p, np_features(p, x) + SIDE_SCALE * side.numpy())
    alg = with_prototypes([0.0, 0.0, 0.0])
    assert_close_finite(alg.predict(network(True), p, x, side), want)


def np_objective(p: dict[str, Tensor], x: Tensor, y: Tensor, side: np.ndarray, known: np.ndarray, lam: float) -> float:
    f = np_features(p, x)
    logits = np_head(p, f + side)
    z = logits - logits.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    ce = -logp[np.arange(len(y)), y.numpy()].mean()
    dist = ((f - PROTOS[y.numpy()]) ** 2).mean(1) * known[y.numpy()]  # nn.MSELoss: mean over features too
    return float(ce + lam * dist.mean())


def test_objective_passes_the_client_side_information_per_sample() -> None:
    p, (x, y) = weights(), inputs(4)
    s = torch.tensor([0.75, -0.5], dtype=torch.float64)  # the client's side vector, one per sample in the batch
    ctx = ClientContext(network(True), 0, x, y, s, ClientOptimizer(), F.cross_entropy, make_generator(0, "proto"))
    alg = with_prototypes([3.0, 0.0, 1.0], lam=0.7)
    got = alg.objective(ctx).losses(p, x, y)[0].mean()  # the minibatch loss: the mean of the per-sample losses
    known = np.array([1.0, 0.0, 1.0])
    assert_close_finite(got, np_objective(p, x, y, SIDE_SCALE * s.numpy()[None, :], known, 0.7))


@pytest.mark.parametrize("weighting", ["client", "count"])
@pytest.mark.parametrize("lam", [0.0, 1.3])
def test_client_update_reports_the_loss_steps_once_and_uploads_class_sums(lam: float, weighting: str) -> None:
    """One epoch of one minibatch holding all 5 samples: the reported loss is the objective at the start (the mean
    over the batch does not depend on the shuffle); the first momentum-SGD step is −lr·∇; the uploaded class sums
    are of the features that step computed (``count``: the sums and the histogram; ``client``: the class means and
    a 1 per held class)."""
    p, (x, y) = weights(), inputs(5)  # labels 0, 2, 2, 1, 0
    lr = 0.2
    opt = ClientOptimizer(lr=lr, momentum=0.9, batch_size=8)
    ctx = ClientContext(network(False), 0, x, y, None, opt, F.cross_entropy, make_generator(1, "proto"))
    alg = with_prototypes([1.0, 0.0, 4.0], lam=lam, weighting=weighting)
    known = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    up = alg.client_update(ctx, p, alg.init_client_state(p))

    leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    f = x @ leaves["body.weight"].T + leaves["body.bias"]
    logits = f @ leaves["head.weight"].T + leaves["head.bias"]
    protos = torch.tensor(PROTOS, dtype=torch.float64)
    ref = -torch.log_softmax(logits, 1)[torch.arange(5), y].mean() + lam * (
        ((f - protos[y]) ** 2).mean(1) * known[y]
    ).mean()
    grads = torch.autograd.grad(ref, list(leaves.values()))
    assert_close_finite(float(up.loss), np_objective(p, x, y, np.zeros((1, H)), known.numpy(), lam))
    assert_close_finite(float(up.loss), float(ref.detach()))
    new = {n: p[n] - lr * g for n, g in zip(leaves, grads)}
    assert sorted(up.state) == sorted(p)
    for n in p:
        assert_close_finite(up.state[n], new[n])
    f_seen = np_features(p, x)  # the prototypes come from the training pass's features (before its one step)
    sums = np.zeros((C, H))
    for i, label in enumerate(y.tolist()):
        sums[label] += f_seen[i]
    counts = np.array([2.0, 1.0, 2.0])
    if weighting == "client":
        sums, counts = sums / counts[:, None], np.ones(3)
    assert_close_finite(up.upload["class_feature_sums"], sums)
    assert_close_finite(up.upload["class_counts"], counts)
    assert up.num_samples == 5


# -- constructor and compatibility ---------------------------------------------------------------------------------
def test_defaults_and_argument_checks() -> None:
    alg = FedProto()
    assert alg.lam == 1.0 and alg.local_epochs == 1 and alg.inference == "prototype"
    assert tuple(alg.global_prototypes.shape) == (0, 0) and tuple(alg.prototype_counts.shape) == (0,)
    assert set(alg.state_dict()) == {"global_prototypes", "prototype_counts"}
    assert FedProto(lam=0.0, local_epochs=3, inference="head").lam == 0.0
    assert FedProto(lam=0.0, local_epochs=3, inference="head").local_epochs == 3
    assert FedProto(inference="head").inference == "head"
    with pytest.raises(ConfigError, match="lam"):
        FedProto(lam=-1e-9)
    for bad in ("HEAD", "proto", ""):
        with pytest.raises(ConfigError, match="inference"):
            FedProto(inference=bad)  # type: ignore[arg-type]
    assert alg.weighting == "client" and FedProto(weighting="count").weighting == "count"
    with pytest.raises(ConfigError, match="weighting"):
        FedProto(weighting="samples")  # type: ignore[arg-type]


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, 5)
        self.b = nn.Linear(5, C)

    def forward(self, z: Tensor) -> Tensor:
        return self.b(self.a(z))


def test_check_compatible_sizes_prototypes_by_the_heads_first_linear_layer() -> None:
    alg = FedProto()
    alg.check_compatible(SplitModel(nn.Linear(D, 4), nn.Sequential(nn.Flatten(), nn.Linear(4, C))), 7)
    assert tuple(alg.global_prototypes.shape) == (7, 4) and tuple(alg.prototype_counts.shape) == (7,)
    assert not alg.known.any()
    alg.check_compatible(SplitModel(nn.Linear(D, H), Pair()), 3)  # first Linear: H → 5, so H features
    assert tuple(alg.global_prototypes.shape) == (3, H) and tuple(alg.prototype_counts.shape) == (3,)
    alg.prototype_counts.fill_(2.0)
    alg.global_prototypes.fill_(0.5)
    alg.check_compatible(SplitModel(nn.Linear(D, H), Pair()), 3)  # already of that size (restored): kept
    assert_close_finite(alg.global_prototypes, np.full((3, H), 0.5))
    assert_close_finite(alg.prototype_counts, np.full(3, 2.0))
    alg.check_compatible(BodyHead(), 5)  # no side attribute: no side branch
    assert tuple(alg.global_prototypes.shape) == (5, H)
    with pytest.raises(ConfigError, match="classification"):
        alg.check_compatible(network(False), None)
    with pytest.raises(ConfigError, match=r"^FedProto needs .*: its prototypes are the body's features; Linear has"):
        alg.check_compatible(nn.Linear(D, C), 3)
    with pytest.raises(ConfigError, match="side"):
        alg.check_compatible(network(True), 3)
    with pytest.raises(ConfigError, match="linear"):
        alg.check_compatible(SplitModel(nn.Linear(D, H), nn.Sequential(nn.ReLU())), 3)


def test_fedproto_resized_prototypes_are_zero_and_on_the_buffers_device():
    alg = FedProto()
    alg.size_prototypes(3, 4)
    assert torch.equal(alg.global_prototypes, torch.zeros(3, 4))
    assert torch.equal(alg.prototype_counts, torch.zeros(3))
    moved = FedProto().to("meta")
    moved.size_prototypes(3, 4)
    assert moved.global_prototypes.device.type == "meta" and moved.global_prototypes.shape == (3, 4)
    assert moved.prototype_counts.device.type == "meta" and moved.prototype_counts.shape == (3,)
    assert moved.known.device.type == "meta"


def test_fedproto_keeps_prototypes_of_the_right_size():
    """Already ``[classes, features]`` (e.g. restored from a checkpoint): kept as they are."""
    alg = FedProto()
    alg.size_prototypes(2, 3)
    alg.global_prototypes.fill_(1.5)
    alg.prototype_counts.fill_(4.0)
    alg.size_prototypes(2, 3)
    assert torch.equal(alg.global_prototypes, torch.full((2, 3), 1.5))
    assert torch.equal(alg.prototype_counts, torch.full((2,), 4.0))
