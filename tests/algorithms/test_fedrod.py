"""FedRoD (Chen & Chao 2022; ``fl_lightning/algorithms/fedrod.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedRoD
from fl_lightning.algorithms.fedrod import log_prior
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FederatedModule, FineTune
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.heavy_ball_mlp import (
    FULL_BATCH,
    LR,
    MLP,
    TOL,
    HeavyBall,
    assert_evaluation,
    digits,
    far,
    fit,
    grads,
    leaves,
    mlp_features,
    mlp_forward,
    scores,
    weighted_mean,
)
from tests.helpers.training import make_trainer


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


LR_2, MOM = 0.1, 0.5


D_IN, D_Z, D_SIDE, CLASSES = 4, 3, 2, 3


class Body(nn.Module):
    """A linear layer, plus one (``spare``) that the forward pass never uses: its gradient is None."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D_IN, D_Z)
        self.spare = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class AddSide(nn.Module):
    """z + s Aᵀ: a side-information branch with its own trained parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(D_Z, D_SIDE) * 0.5)

    def forward(self, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return z + s @ self.a.T


def network(side: bool, bias: bool = True, dtype: torch.dtype = torch.float32) -> SplitModel:
    torch.manual_seed(3)
    return SplitModel(Body(), nn.Linear(D_Z, CLASSES, bias=bias), AddSide() if side else None).to(dtype)


def client_data(n: int = 7, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, D_IN, generator=g, dtype=dtype)
    y = torch.tensor([0, 1, 0, 0, 1, 0, 1][:n])  # class 2 absent: log π₂ = −inf
    side = torch.randn(D_SIDE, generator=g, dtype=dtype)
    return x, y, side


def reference(net, x, y, side, batch_size, epochs, budget, gen_parts, personal0):
    """Plain torch: per minibatch (the client's shuffle replayed from its generator), body/side/generic head step on
    CE(h_G(z) + log π, y) and the personal head on CE(h_G(z) + h_P(z), y) with z and h_G(z) detached; the step
    cap of a straggler is max(1, ⌊budget · epochs · ⌈n / B⌉⌋)."""
    net = copy.deepcopy(net)
    n = x.shape[0]
    counts = np.bincount(y.numpy(), minlength=CLASSES).astype(np.float64)
    with np.errstate(divide="ignore"):
        shift = torch.from_numpy(np.log(counts / n)).to(x.dtype)
    personal = {k: v.clone().requires_grad_(True) for k, v in personal0.items()}
    opt_s = torch.optim.SGD(net.parameters(), lr=LR_2, momentum=MOM)
    opt_p = torch.optim.SGD(list(personal.values()), lr=LR_2, momentum=MOM)
    per_epoch = -(-n // batch_size)
    total = epochs * per_epoch if budget >= 1 else max(1, int(budget * epochs * per_epoch))
    g = make_generator(*gen_parts)
    steps, losses = 0, []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for i in range(0, n, batch_size):
            if steps == total:
                break
            idx = perm[i : i + batch_size]
            xb, yb = x[idx], y[idx]
            z = net.body(xb)
            if getattr(net, "side", None) is not None:
                z = net.side(z, side.expand(xb.shape[0], D_SIDE))
            generic = net.head(z)
            loss_g = F.cross_entropy(generic + shift, yb)
            h_p = z.detach() @ personal["weight"].T + (personal["bias"] if "bias" in personal else 0)
            loss_p = F.cross_entropy(generic.detach() + h_p, yb)
            opt_s.zero_grad(set_to_none=True)
            opt_p.zero_grad(set_to_none=True)
            (loss_g + loss_p).backward()  # loss_p reaches only the personal head
            opt_s.step()
            opt_p.step()
            losses.append(float(loss_p.detach()))
            steps += 1
    shared = {k: v.detach() for k, v in net.named_parameters()}
    return shared, {k: v.detach() for k, v in personal.items()}, sum(losses) / len(losses), steps


def test_log_prior_is_the_log_of_each_class_frequency():
    y = torch.tensor([0, 0, 1, 3, 0, 3])
    out = log_prior(y, 5, torch.float64)
    assert out.dtype == torch.float64 and out.shape == (5,)
    assert_close_finite(out[[0, 1, 3]], np.log([3 / 6, 1 / 6, 2 / 6]))
    assert torch.isneginf(out[[2, 4]]).all()
    one = log_prior(torch.tensor([1]), 3, torch.float64)  # one sample: π = (0, 1, 0)
    assert float(one[1]) == 0.0 and torch.isneginf(one[[0, 2]]).all()


@pytest.mark.parametrize(
    "side, bias, batch_size, epochs, budget, expected_steps, dtype",
    [
        (True, True, 3, 2, 1.0, 6, torch.float32),  # ⌈7/3⌉ = 3 minibatches an epoch (the last of one sample), 2 epochs
        (True, True, 3, 2, 0.5, 3, torch.float32),  # a straggler: ⌊0.5 · 2 · 3⌋ = 3 steps, the first epoch
        (False, False, 3, 2, 0.1, 1, torch.float32),  # at least one step; a bias-free head
        (False, True, 2, 3, 0.6, 7, torch.float32),  # ⌊0.6 · 3 · 4⌋ = 7: the cap falls inside the second epoch
        (True, True, 3, 2, 1.0, 6, torch.float64),  # float64: log π in float64 too (1e-10 agreement)
    ],
)
def test_fedrod_client_update_equals_the_plain_torch_reference(
    side, bias, batch_size, epochs, budget, expected_steps, dtype
):
    net = network(side, bias, dtype)
    x, y, s = client_data(dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    algo = FedRoD(local_epochs=epochs)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo.setup(glob, 4)
    state = algo.init_client_state(glob)
    heads = ["head.weight", "head.bias"] if bias else ["head.weight"]
    assert sorted(state) == sorted("p_head." + n for n in heads)
    assert all(float(t.abs().max()) == 0.0 for t in state.values())
    # a non-zero personal head, as after earlier rounds
    state = {k: torch.full_like(v, 0.3) + torch.arange(v.numel()).view_as(v) * 0.05 for k, v in state.items()}
    opt = ClientOptimizer(lr=LR_2, momentum=MOM, batch_size=batch_size)
    gen_parts = (5, "t", 2, 1)
    ctx = client_context(
        net, x, y, client=1, side=s if side else None, optimizer=opt, loss=F.cross_entropy,
        generator=make_generator(*gen_parts), round_idx=2, step_budget=budget,
    )
    update = algo.client_update(ctx, glob, state)

    personal0 = {n.removeprefix("p_head.head."): v for n, v in state.items()}
    shared, personal, loss, steps = reference(net, x, y, s, batch_size, epochs, budget, gen_parts, personal0)
    assert steps == expected_steps
    assert sorted(update.upload) == sorted(glob)
    for n in glob:
        assert_close_finite(update.upload[n], shared[n], **tol, msg=n)
    assert float((update.upload["body.spare.weight"] - glob["body.spare.weight"]).abs().max()) == 0.0
    assert float((update.upload["head.weight"] - glob["head.weight"]).abs().max()) > 1e-3
    assert sorted(update.state) == sorted(state)
    for k, v in personal.items():
        assert_close_finite(update.state["p_head.head." + k], v, **tol, msg=k)
    assert update.num_samples == 7
    assert update.loss == pytest.approx(loss, rel=tol["rtol"])
    assert float(ctx.train_loss) == pytest.approx(loss, rel=tol["rtol"])
    assert not any(t.requires_grad for t in (*update.upload.values(), *update.state.values()))


def test_fedrod_client_model_adds_the_personal_head_to_the_generic_one():
    net = network(side=False)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedRoD()
    algo.setup(glob, 2)
    state = {"p_head.head.weight": torch.ones(CLASSES, D_Z), "p_head.head.bias": torch.full((CLASSES,), 2.0)}
    model = algo.client_model(glob, state)
    assert sorted(model) == sorted(glob)
    assert_close_finite(model["head.weight"], glob["head.weight"].numpy() + 1.0)
    assert_close_finite(model["head.bias"], glob["head.bias"].numpy() + 2.0)
    assert_close_finite(model["body.fc.weight"], glob["body.fc.weight"])


def head_message(has: str) -> str:
    return (
        r"^FedRoD needs a network whose `head` is one linear classifier layer \(head\.weight with ≥ 2 classes, "
        r"head\.bias\): the generic head, to which the personal head is added; this network's head has "
        + has
        + "$"
    )


@pytest.mark.parametrize("classes, ok", [(1, False), (2, True)])
def test_fedrod_needs_at_least_two_classes(classes, ok):
    net = SplitModel(nn.Linear(D_IN, D_Z), nn.Linear(D_Z, classes))
    glob = {n: p.detach() for n, p in net.named_parameters()}
    if ok:
        FedRoD().setup(glob, 2)
        return
    with pytest.raises(ConfigError, match=head_message(r"head\.weight, head\.bias")):
        FedRoD().setup(glob, 2)


def test_fedrod_rejects_a_head_weight_that_is_not_a_matrix():
    glob = {"body.w": torch.zeros(3, 4), "head.weight": torch.zeros(3, 4, 2)}
    with pytest.raises(ConfigError, match=head_message(r"head\.weight")):
        FedRoD().setup(glob, 2)


def test_fedrod_rejects_a_network_without_head_parameters():
    with pytest.raises(ConfigError, match=head_message("no parameters")):
        FedRoD().setup({"body.w": torch.zeros(3, 4)}, 2)


def test_fedrod_trains_one_local_epoch_by_default():
    assert FedRoD().local_epochs == 1


def test_fedrod_refuses_a_regression_task():
    net = network(side=False)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo = FedRoD()
    algo.setup(glob, 2)
    message = r"^FedRoD is a classification method \(balanced softmax over classes\); the task has none$"
    with pytest.raises(ConfigError, match=message):  # checked before set-up (num_classes None: regression)
        algo.check_compatible(net, None)
    algo.check_compatible(net, 3)


class BodyHead(nn.Module):
    """A network with ``body`` and ``head`` and no ``side`` attribute at all (not a SplitModel)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body, self.head = Body(), nn.Linear(D_Z, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_fedrod_runs_on_a_network_without_a_side_attribute():
    net = BodyHead()
    x, y, _ = client_data()
    algo = FedRoD(local_epochs=2)
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    algo.setup(glob, 2)
    state = algo.init_client_state(glob)
    opt = ClientOptimizer(lr=LR_2, momentum=MOM, batch_size=3)
    ctx = client_context(
        net, x, y, client=1, optimizer=opt, loss=F.cross_entropy, generator=make_generator(5, "t", 2, 1), round_idx=2,
    )
    update = algo.client_update(ctx, glob, state)
    personal0 = {n.removeprefix("p_head.head."): v for n, v in state.items()}
    shared, personal, loss, steps = reference(net, x, y, None, 3, 2, 1.0, (5, "t", 2, 1), personal0)
    assert steps == 6
    for n in glob:
        assert_close_finite(update.upload[n], shared[n], rtol=1e-5, atol=1e-6, msg=n)
    for k, v in personal.items():
        assert_close_finite(update.state["p_head.head." + k], v, rtol=1e-5, atol=1e-6, msg=k)
