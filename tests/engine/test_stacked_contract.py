"""The client contract (``fl_lightning.client.Client``): both executors implement all of it, and an algorithm
written against it gives on K stacked clients (``VectorizedContext``) what the sequential reference
(``ClientContext``) gives client by client: uploads, client state, losses, to 1e-5. BatchNorm statistics of the
stacked path against torch's own ``BatchNorm2d`` in train mode."""

from __future__ import annotations

import copy
import functools
import inspect
from collections import OrderedDict

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fl_lightning.algorithms.apfl import APFL
from fl_lightning.algorithms.base import Algorithm
from fl_lightning.algorithms.ditto import Ditto
from fl_lightning.algorithms.fedbn import FedBN
from fl_lightning.algorithms.feddyn import FedDyn
from fl_lightning.algorithms.fedproto import FedProto
from fl_lightning.algorithms.fedrod import FedRoD
from fl_lightning.algorithms.moon import MOON
from fl_lightning.algorithms.perfedavg import PerFedAvg
from fl_lightning.algorithms.pfedme import PFedMe
from fl_lightning.client import Client, ClientOptimizer
from fl_lightning.engine.sequential import ClientContext, FunctionalBatchNorm, loss_fn_for
from fl_lightning.engine.stacked import VectorizedContext, per_sample_loss_for, stack, unstack
from fl_lightning.models.split import Concat, SplitModel
from tests.helpers.asserts import assert_close_finite

CLASSES = 4
TOL = 1e-5
SIZES = [9, 5, 12]  # partial last batches of different lengths: padded rows on the stacked path


def mlp() -> SplitModel:
    body = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 6), nn.ReLU())
    return SplitModel(body, nn.Linear(6, CLASSES))


def cnn(batchnorm: bool = False) -> SplitModel:
    layers: OrderedDict[str, nn.Module] = OrderedDict(conv1=nn.Conv2d(1, 3, 3, padding=1))
    if batchnorm:
        layers["bn1"] = nn.BatchNorm2d(3)
    layers.update(relu1=nn.ReLU(), pool=nn.MaxPool2d(2), conv2=nn.Conv2d(3, 4, 3, padding=1))
    if batchnorm:
        layers["bn2"] = nn.BatchNorm2d(4, momentum=None)  # the cumulative average: 1/num_batches_tracked
    layers.update(relu2=nn.ReLU(), flat=nn.Flatten())
    return SplitModel(nn.Sequential(layers), nn.Linear(16, CLASSES))


NETS = {"mlp": lambda: mlp(), "cnn": lambda: cnn(), "cnn_bn": lambda: cnn(batchnorm=True)}


def client_data(seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 1, 4, 4, generator=g) for n in SIZES]
    # each client misses a class (FedRoD's −inf prior, FedProto's unknown prototypes)
    ys = [torch.randint(0, CLASSES - 1, (n,), generator=g) + (k % 2) for k, n in enumerate(SIZES)]
    return xs, ys


def generators(seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + k) for k in range(len(SIZES))]


def settings() -> ClientOptimizer:
    return ClientOptimizer(lr=0.05, momentum=0.5, weight_decay=1e-3, batch_size=4)


def sequential(net: nn.Module, k: int, seed: int) -> ClientContext:
    xs, ys = client_data()
    return ClientContext(net, k, xs[k], ys[k], None, settings(), loss_fn_for(CLASSES), generators(seed)[k], seed=seed)


def stacked(net: nn.Module, seed: int, loop_over_clients: bool) -> VectorizedContext:
    xs, ys = client_data()
    return VectorizedContext(
        net, list(range(len(SIZES))), xs, ys, None, settings(), per_sample_loss_for(CLASSES), generators(seed),
        None, 0, seed, [1.0, 0.5, 1.0], loop_over_clients=loop_over_clients,
    )  # fmt: skip


def perturbed_states(algorithm: Algorithm, glob: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """Each client's bank row: the template, moved off it so that per-client state matters."""
    template = algorithm.init_client_state(glob)
    out = []
    for k in range(len(SIZES)):
        g = torch.Generator().manual_seed(50 + k)
        row = {}
        for n, v in template.items():
            if not v.is_floating_point():
                row[n] = v.clone()
            elif n.endswith("running_var"):
                row[n] = v + torch.rand(v.shape, generator=g)
            else:
                row[n] = v + 0.1 * torch.randn(v.shape, generator=g)
        out.append(row)
    return out


def run_both(algorithm: Algorithm, net_name: str, loop_over_clients: bool, seed: int = 3):
    """One ``client_update`` through each executor from the same global model and bank rows."""
    torch.manual_seed(seed)
    net = NETS[net_name]()
    net.train()
    algorithm.check_compatible(net, CLASSES)
    glob = {n: t.detach().clone() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    algorithm.setup(glob, 10)
    states = perturbed_states(algorithm, glob)
    ref = []
    for k in range(len(SIZES)):
        ctx = sequential(net, k, seed)
        ctx.step_budget = [1.0, 0.5, 1.0][k]
        ref.append(algorithm.client_update(ctx, {n: v.clone() for n, v in glob.items()}, dict(states[k])))
    vctx = stacked(net, seed, loop_over_clients)
    expanded = {n: v.expand(len(SIZES), *v.shape) for n, v in glob.items()}
    before = {n: v.clone() for n, v in glob.items()}
    out = algorithm.client_update(vctx, expanded, stack(states) if states[0] else {})
    for n, v in glob.items():  # the stacked path never writes into the global model it was given
        assert torch.equal(v, before[n]), n
    return ref, out


def check_equal(ref, out, tol: float = TOL) -> None:
    assert out.num_samples == SIZES
    for k, upd in enumerate(ref):
        mine = unstack(out.upload, k)
        assert set(mine) == set(upd.upload)
        for n, v in upd.upload.items():
            assert_close_finite(mine[n], v, rtol=tol, atol=tol, msg=f"upload {n} of client {k}")
        state = unstack(out.state, k)
        assert set(state) == set(upd.state)
        for n, v in upd.state.items():
            assert_close_finite(state[n], v, rtol=tol, atol=tol, msg=f"state {n} of client {k}")
        assert_close_finite(out.loss[k], upd.loss, rtol=tol, atol=tol, msg=f"loss of client {k}")


CASES = {
    "moon": lambda: MOON(mu=2.0, temperature=0.5, local_epochs=2),
    "fedproto": lambda: FedProto(lam=0.5, local_epochs=2),
    "feddyn": lambda: FedDyn(alpha=0.1, local_epochs=2),
    "pfedme": lambda: PFedMe(lam=5.0, personal_lr=0.05, inner_steps=2, local_steps=4),
    "fedrod": lambda: FedRoD(local_epochs=2),
    "fedbn": lambda: FedBN(local_epochs=2),
    "ditto": lambda: Ditto(lam=0.5, local_epochs=1, personal_epochs=2),
    # a Gradient with forward passes on two batches per step (BatchNorm statistics of each, chained)
    "perfedavg": lambda: PerFedAvg(inner_lr=0.02, support=3, target=2, local_epochs=2),
    "apfl": lambda: APFL(alpha=0.3, local_epochs=2),
}
#: (network, loop_over_clients): the MLP steps with batched matrix products or vmap; convolutional phases vmap
#: (accelerators) or run client by client (the CPU's default); FedBN needs BatchNorm layers.
PATHS = [("mlp", False), ("cnn", False), ("cnn", True), ("cnn_bn", False), ("cnn_bn", True)]
COMBOS = [(a, net, loop) for a in CASES for net, loop in PATHS if a != "fedbn" or net == "cnn_bn"]


@pytest.mark.parametrize(("name", "net_name", "loop"), COMBOS)
def test_client_update_stacked_equals_the_sequential_loop(name: str, net_name: str, loop: bool) -> None:
    """Three clients of 9, 5 and 12 samples (client 1 a straggler with half its steps): every upload, every state
    tensor (BatchNorm statistics included) and every reported loss of the stacked update equals the loop's."""
    algorithm = CASES[name]()
    if name == "fedproto":  # global prototypes for all classes but the last (sized by check_compatible)
        algorithm.check_compatible(NETS[net_name](), CLASSES)
        algorithm.global_prototypes.copy_(torch.randn(algorithm.global_prototypes.shape, generator=gen(1)))
        algorithm.prototype_counts[:-1] = 3.0
    ref, out = run_both(algorithm, net_name, loop)
    check_equal(ref, out)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the protocol --------------------------------------------------------------------------------------------
def protocol_members() -> tuple[list[str], list[str], list[str]]:
    """(methods, properties, data attributes) that ``Client`` declares."""
    methods = [n for n, v in vars(Client).items() if inspect.isfunction(v) and not n.startswith("_")]
    properties = [n for n, v in vars(Client).items() if isinstance(v, property)]
    return methods, properties, list(Client.__annotations__)


def shape_of(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    """A signature's parameters: name, kind and default (annotations differ: one client or K stacked)."""
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.parametrize("cls", [ClientContext, VectorizedContext])
def test_both_contexts_implement_every_member_of_the_client_protocol_with_its_signature(cls: type) -> None:
    methods, properties, attributes = protocol_members()
    assert {"sgd", "forward", "per_sample_loss", "batch_loss", "label_counts", "mean_loss"} <= set(methods)
    assert {"num_samples"} <= set(properties)
    assert {"net", "optimizer_state", "train_loss", "steps_taken", "round", "seed", "step_budget"} <= set(attributes)
    assert "class_sums_seen" in attributes
    for name in methods:
        mine = getattr(cls, name, None)
        assert inspect.isfunction(mine), f"{cls.__name__} has no method {name}"
        assert shape_of(inspect.signature(mine)) == shape_of(inspect.signature(getattr(Client, name))), name
    for name in properties:
        assert isinstance(getattr(cls, name, None), property), f"{cls.__name__}.{name} is not a property"
    net = mlp()
    instance = sequential(net, 0, 0) if cls is ClientContext else stacked(net, 0, False)
    for name in attributes:
        assert hasattr(instance, name), f"{cls.__name__} has no attribute {name}"


def test_stacked_contract_values_are_the_sequential_ones_per_client() -> None:
    """``num_samples``, ``step_budget`` and ``label_counts`` of the stacked context are each client's, in order."""
    vctx = stacked(mlp(), 0, False)
    counts = vctx.label_counts(CLASSES)
    _, ys = client_data()
    for k in range(3):
        ctx = sequential(mlp(), k, 0)
        assert vctx.num_samples[k] == ctx.num_samples == SIZES[k] and vctx.step_budget[k] == [1.0, 0.5, 1.0][k]
        assert torch.equal(counts[k], ctx.label_counts(CLASSES))
        assert counts[k].tolist() == [int((ys[k] == c).sum()) for c in range(CLASSES)]


# ---- BatchNorm statistics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dims", [2, 4])
def test_functional_batchnorm_in_vmap_equals_torch_batchnorm_per_client(momentum: float | None, dims: int) -> None:
    """Per-client statistics ``[K, ...]`` under ``vmap`` over padded batches of 6, 3 and 5 real rows: the outputs of the
    real rows, the new running mean and (unbiased) variance and ``num_batches_tracked`` are torch's ``BatchNorm``
    applied to each client's real rows in train mode; padding rows change nothing."""
    g = gen(4)
    bn = (nn.BatchNorm1d if dims == 2 else nn.BatchNorm2d)(3, momentum=momentum)
    bn.train()
    lengths, width = [6, 3, 5], 6
    shape = (width, 3) if dims == 2 else (width, 3, 2, 3)
    x = torch.randn(3, *shape, generator=g)
    mask = torch.stack([(torch.arange(width) < n).float() for n in lengths])
    x = torch.where(mask.view(3, width, *[1] * (dims - 1)) > 0, x, 1e3)  # padding: far off, must not count
    params = {
        "weight": 1 + 0.1 * torch.randn(3, 3, generator=g),
        "bias": 0.1 * torch.randn(3, 3, generator=g),
        "running_mean": torch.randn(3, 3, generator=g),
        "running_var": torch.rand(3, 3, generator=g) + 0.5,
        "num_batches_tracked": torch.tensor([0, 4, 9]),
    }
    with FunctionalBatchNorm(bn) as functional:

        def one(p: dict[str, Tensor], xb: Tensor, m: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            functional.begin(m)
            return functional_call(bn, p, (xb,)), functional.updates(p)

        out, new = vmap(one)(params, x, mask)
    for k, n in enumerate(lengths):
        ref = copy.deepcopy(bn)
        ref.load_state_dict({name: v[k] for name, v in params.items()})
        expected = ref(x[k, :n])
        assert_close_finite(out[k, :n], expected, rtol=TOL, atol=TOL)
        for name in ("running_mean", "running_var"):
            assert_close_finite(new[name][k], getattr(ref, name), rtol=TOL, atol=TOL, msg=name)
        assert (
            int(new["num_batches_tracked"][k])
            == int(ref.num_batches_tracked)
            == int(params["num_batches_tracked"][k]) + 1
        )


def test_functional_batchnorm_in_eval_mode_normalises_with_the_running_statistics_and_updates_nothing() -> None:
    bn = nn.BatchNorm2d(2).eval()
    g = gen(5)
    params = {"weight": torch.rand(2, generator=g) + 0.5, "bias": torch.randn(2, generator=g),
              "running_mean": torch.randn(2, generator=g), "running_var": torch.rand(2, generator=g) + 0.5,
              "num_batches_tracked": torch.tensor(3)}  # fmt: skip
    x = torch.randn(4, 2, 3, 3, generator=g)
    with FunctionalBatchNorm(bn) as functional:
        functional.begin(torch.ones(4))
        out = functional_call(bn, params, (x,))
        assert functional.updates(params) == {}
    shape = (1, 2, 1, 1)
    ref = (x - params["running_mean"].view(shape)) / (params["running_var"].view(shape) + bn.eps).sqrt()
    assert_close_finite(out, ref * params["weight"].view(shape) + params["bias"].view(shape), rtol=TOL, atol=TOL)
    assert bn.forward.__func__ is nn.BatchNorm2d.forward  # the module's own forward is back


# ---- side information inside an objective ---------------------------------------------------------------------
def side_net() -> SplitModel:
    """A body, a side branch concatenating W(z) to the features, a linear head."""
    return SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(16, 5), nn.Tanh()), nn.Linear(7, CLASSES),
                      Concat(nn.Linear(3, 2)))  # fmt: skip


@pytest.mark.parametrize("name", ["moon", "fedrod"])
@pytest.mark.parametrize("optimizer", ["sgd", "rmsprop"])  # RMSprop has no batched form: client by client
def test_an_objective_sees_each_clients_side_information(name: str, optimizer: str) -> None:
    """``ctx.side_for`` inside an ``Objective`` is the client's own side vector on both paths (``vmap``, and
    client by client); the clients' side vectors differ, so a mix-up shows in the uploads."""
    torch.manual_seed(2)
    net = side_net().train()
    algorithm = CASES[name]()
    algorithm.check_compatible(net, CLASSES)
    glob = {n: t.detach().clone() for n, t in net.named_parameters()}
    algorithm.setup(glob, 10)
    states = perturbed_states(algorithm, glob)
    opt = settings() if optimizer == "sgd" else ClientOptimizer.from_config(
        functools.partial(torch.optim.RMSprop, lr=0.01), batch_size=4)  # fmt: skip
    xs, ys = client_data()
    sides = [torch.randn(3, generator=gen(20 + k)) for k in range(len(SIZES))]
    ref = []
    for k in range(len(SIZES)):
        ctx = ClientContext(net, k, xs[k], ys[k], sides[k], opt, loss_fn_for(CLASSES), generators(1)[k])
        ref.append(algorithm.client_update(ctx, dict(glob), dict(states[k])))
    vctx = VectorizedContext(net, list(range(3)), xs, ys, sides, opt, per_sample_loss_for(CLASSES), generators(1),
                             None, 0, 1, [1.0] * 3)  # fmt: skip
    out = algorithm.client_update(vctx, {n: v.expand(3, *v.shape) for n, v in glob.items()}, stack(states))
    for k, upd in enumerate(ref):
        for n, v in upd.upload.items():
            assert_close_finite(out.upload[n][k], v, rtol=TOL, atol=TOL, msg=f"upload {n} of client {k}")
        assert_close_finite(out.loss[k], upd.loss, rtol=TOL, atol=TOL)


# ---- full-batch gradients (Per-FedAvg's evaluation-time adaptation) -------------------------------------------
@pytest.mark.parametrize("net_name", ["mlp", "cnn", "side"])
def test_full_gradient_is_each_clients_own_gradient_on_all_its_rows(net_name: str) -> None:
    """``full_gradient`` on both contexts against plain autograd of each client's mean cross-entropy over all of
    its rows with its own parameters; the clients have different sizes (padding on the stacked path), one has no
    data (zeros), and the side-branch network gets each client's own side vector."""
    torch.manual_seed(4)
    net = {"mlp": mlp, "cnn": cnn, "side": side_net}[net_name]().train()
    xs, ys = client_data()
    xs, ys = [*xs, xs[0][:0]], [*ys, ys[0][:0]]  # a fourth client without data
    sides = [torch.randn(3, generator=gen(30 + k)) for k in range(4)] if net_name == "side" else None
    own = [{n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen(40 + k)) for n, p in net.named_parameters()}
           for k in range(4)]  # fmt: skip
    frozen = "body.1." if net_name == "mlp" else "no frozen parameter"  # the MLP's first Linear stays frozen
    names = [n for n, _ in net.named_parameters() if not n.startswith(frozen)]
    vctx = VectorizedContext(net, list(range(4)), xs, ys, sides, settings(), per_sample_loss_for(CLASSES),
                             [gen(k) for k in range(4)], None, 0, 0, [1.0] * 4)  # fmt: skip
    stacked_grads = vctx.full_gradient(stack(own), names)
    for k in range(4):
        leaves = {n: v.clone().requires_grad_(n in names) for n, v in own[k].items()}
        if xs[k].shape[0]:
            kwargs = {} if sides is None else {"side": sides[k].expand(xs[k].shape[0], 3)}
            loss = F.cross_entropy(functional_call(net, leaves, (xs[k],), kwargs), ys[k])
            expected = dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))
        else:
            expected = {n: torch.zeros_like(own[k][n]) for n in names}
        ctx = ClientContext(net, k, xs[k], ys[k], None if sides is None else sides[k], settings(),
                            loss_fn_for(CLASSES), gen(k))  # fmt: skip
        sequential_grads = ctx.full_gradient(own[k], names)
        assert set(stacked_grads) == set(sequential_grads) == set(names)
        for n in names:
            assert_close_finite(sequential_grads[n], expected[n], rtol=TOL, atol=1e-6, msg=f"{n} of client {k}")
            assert_close_finite(stacked_grads[n][k], expected[n], rtol=TOL, atol=1e-6, msg=f"{n} of client {k}")
    assert len(names) < len(own[0]) or net_name != "mlp"
    assert vctx.side_for(2) is None  # the call leaves no client's side vector behind


def test_full_gradient_without_names_or_data_is_empty_or_zero() -> None:
    net = mlp()
    xs, ys = client_data()
    empty = VectorizedContext(net, [0, 1], [xs[0][:0], xs[1][:0]], [ys[0][:0], ys[1][:0]], None, settings(),
                              per_sample_loss_for(CLASSES), [gen(0), gen(1)], None, 0, 0, [1.0, 1.0])  # fmt: skip
    params = stack([{n: p.detach() for n, p in net.named_parameters()}] * 2)
    zeros = empty.full_gradient(params, ["head.weight"])
    assert list(zeros) == ["head.weight"] and zeros["head.weight"].shape == (2, CLASSES, 6)
    assert not zeros["head.weight"].any()
    assert empty.full_gradient(params, []) == {}
