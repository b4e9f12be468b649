"""FedProto (Tan et al. 2022) on one client against references written here: the prototype logits
−‖φ(x) − C̄^(j)‖²₂ with unknown classes one below the farthest known one, the head path (``inference: head``, or
before any prototype exists) as the network's forward with its side information and its own buffers, the local
objective CE + λ‖φ(x) − C̄^(y)‖²₂ with per-sample side information, and one client update (the reported loss,
the SGD step, the uploaded per-class sums and counts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedProto
from fl_lightning.algorithms.representation import features_and_outputs, require_body
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models.split import SplitModel

D, H, C = 3, 2, 3  # input dim, feature dim, classes
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


def weights() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "body.weight": torch.randn(H, D, generator=g, dtype=torch.float64),
        "body.bias": torch.randn(H, generator=g, dtype=torch.float64),
        "head.weight": torch.randn(C, H, generator=g, dtype=torch.float64),
        "head.bias": torch.randn(C, generator=g, dtype=torch.float64),
    }


def inputs(n: int = 4) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 2, 2, 1, 0, 2][:n])
    return x, y


PROTOS = np.array([[1.0, -0.5], [0.3, 0.2], [-1.0, 2.0]])


def with_prototypes(counts: list[float], **kw: object) -> FedProto:
    alg = FedProto(**kw)  # type: ignore[arg-type]
    alg.global_prototypes = torch.tensor(PROTOS, dtype=torch.float64)
    alg.prototype_counts = torch.tensor(counts, dtype=torch.float64)
    return alg


def np_features(p: dict[str, Tensor], x: Tensor) -> np.ndarray:
    return x.numpy() @ p["body.weight"].numpy().T + p["body.bias"].numpy()


def np_head(p: dict[str, Tensor], z: np.ndarray) -> np.ndarray:
    return z @ p["head.weight"].numpy().T + p["head.bias"].numpy()


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
    got = alg.objective(ctx)(p, x, y)
    known = np.array([1.0, 0.0, 1.0])
    assert_close_finite(got, np_objective(p, x, y, SIDE_SCALE * s.numpy()[None, :], known, 0.7))


@pytest.mark.parametrize("lam", [0.0, 1.3])
def test_client_update_reports_the_loss_steps_once_and_uploads_class_sums(lam: float) -> None:
    """One epoch of one minibatch holding all 5 samples: the reported loss is the objective at the start (the mean
    over the batch does not depend on the shuffle); the first momentum-SGD step is −lr·∇."""
    p, (x, y) = weights(), inputs(5)  # labels 0, 2, 2, 1, 0
    lr = 0.2
    opt = ClientOptimizer(lr=lr, momentum=0.9, batch_size=8)
    ctx = ClientContext(network(False), 0, x, y, None, opt, F.cross_entropy, make_generator(1, "proto"))
    alg = with_prototypes([1.0, 0.0, 4.0], lam=lam)
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
    f_new = np_features(new, x)
    sums = np.zeros((C, H))
    for i, label in enumerate(y.tolist()):
        sums[label] += f_new[i]
    assert_close_finite(up.upload["class_feature_sums"], sums)
    assert_close_finite(up.upload["class_counts"], np.array([2.0, 1.0, 2.0]))
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


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(H, 5)
        self.b = nn.Linear(5, C)

    def forward(self, z: Tensor) -> Tensor:
        return self.b(self.a(z))


class BodyHead(nn.Module):
    """A body and a head but no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, H)
        self.head = nn.Linear(H, C)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


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


# -- the representation helpers FedProto uses ----------------------------------------------------------------------
class GainSide(nn.Module):
    """``gain · z + s`` with a trained ``gain``."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, z: Tensor, s: Tensor) -> Tensor:
        return self.gain * z + s


def test_features_and_outputs_use_the_given_side_parameters() -> None:
    p, (x, _) = weights(), inputs()
    side = torch.tensor([[0.5, -1.0]], dtype=torch.float64).expand(4, 2)
    net = SplitModel(nn.Linear(D, H), nn.Linear(H, C), GainSide()).double()
    feats, out = features_and_outputs(net, {**p, "side.gain": torch.tensor(3.0, dtype=torch.float64)}, x, side)
    f = np_features(p, x)
    assert_close_finite(feats, f)
    assert_close_finite(out, np_head(p, 3.0 * f + side.numpy()))  # the given gain 3, not the module's 1


def test_features_and_outputs_of_a_network_without_a_side_attribute() -> None:
    p, (x, _) = weights(), inputs()
    net = BodyHead().double()
    feats, out = features_and_outputs(net, p, x, None)
    assert_close_finite(feats, np_features(p, x))
    assert_close_finite(out, np_head(p, np_features(p, x)))


class BodyOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(D, H)


class HeadOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(H, C)


def test_require_body_needs_both_a_body_and_a_head() -> None:
    require_body("M", BodyHead(), "why")
    for net in (BodyOnly(), HeadOnly(), nn.Linear(D, C)):
        with pytest.raises(ConfigError, match="^M needs a network with a body and a head"):
            require_body("M", net, "why")
