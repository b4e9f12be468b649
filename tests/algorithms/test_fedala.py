"""FedALA (Zhang et al. 2023; ``fl_lightning/algorithms/fedala.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import statistics

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedALA
from fl_lightning.algorithms.fedala import settled
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.counted_model import Counted, D
from tests.helpers.heavy_ball_mlp import (
    HEAD,
    MLP,
    TOL,
    assert_evaluation,
    far,
    fit,
    grads,
    leaves,
    local_sgd,
    mlp_forward,
    scores,
    weighted_mean,
)


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


def ala_state(runs: int) -> dict[str, torch.Tensor]:
    return {"local.head.weight": torch.full((1, D), 4.0, dtype=torch.float64),
            "local.head.bias": torch.full((1,), 4.0, dtype=torch.float64),
            "ala_w.head.weight": torch.full((1, D), 0.25, dtype=torch.float64),
            "ala_w.head.bias": torch.full((1,), 0.25, dtype=torch.float64),
            "ala_runs": torch.tensor(runs)}  # fmt: skip


def test_fedala_client_model_global_before_the_first_run_mixed_after():
    glob = {"head.weight": torch.zeros(1, D, dtype=torch.float64), "head.bias": torch.zeros(1, dtype=torch.float64)}
    algo = FedALA()
    before = algo.client_model(glob, ala_state(0))
    assert float(before["head.weight"].abs().max()) == 0.0 and float(before["head.bias"].abs().max()) == 0.0
    after = algo.client_model(glob, ala_state(1))  # θ + (Θ − θ)·W = 4 − 4·0.25 = 3
    assert_close_finite(after["head.weight"], torch.full((1, D), 3.0), rtol=0, atol=1e-15)
    assert_close_finite(after["head.bias"], [3.0], rtol=0, atol=1e-15)


def test_fedala_first_round_reports_the_sgd_loss():
    """No local model yet: one full-batch SGD step from Θ; the reported loss is the MSE of Θ on the data."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, 1, generator=g, dtype=torch.float64)
    net = Counted()
    glob = {"head.weight": torch.randn(1, D, generator=g, dtype=torch.float64),
            "head.bias": torch.randn(1, generator=g, dtype=torch.float64), "count": torch.tensor(7)}  # fmt: skip
    algo = FedALA()
    ctx = client_context(
        net, x, y, optimizer=ClientOptimizer(lr=0.1, momentum=0.0, batch_size=10), loss=F.mse_loss,
        generator=make_generator(1),
    )
    up = algo.client_update(ctx, glob, algo.init_client_state(glob))
    r = x @ glob["head.weight"].T + glob["head.bias"] - y
    assert float(up.loss) == pytest.approx(float((r**2).mean()), rel=1e-12)
    assert_close_finite(up.upload["head.weight"], glob["head.weight"] - 0.1 * 2 * (r.T @ x) / 4, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "bad", [dict(p=0), dict(s=0.0), dict(s=100.5), dict(eta=0.0), dict(window=1), dict(init_max_epochs=0)]
)
def test_each_out_of_range_argument_is_refused_alone(bad):
    with pytest.raises(ConfigError, match="FedALA needs p ≥ 1, 0 < s ≤ 100"):
        FedALA(**bad)


def test_the_boundaries_themselves_are_accepted():
    alg = FedALA(p=1, s=100.0, eta=1e-6, window=2, init_max_epochs=1)
    assert (alg.p, alg.s, alg.eta, alg.window, alg.init_max_epochs) == (1, 100.0, 1e-6, 2, 1)
    alg = FedALA(s=0.5)  # any positive percentage
    assert alg.s == 0.5


def test_defaults_are_the_papers():
    alg = FedALA()  # FedALA (Zhang et al. 2023): p = 1 layer, s = 80 %, eta = 1, threshold 0.1 over 10 losses
    assert (alg.local_epochs, alg.p, alg.s, alg.eta) == (1, 1, 80.0, 1.0)
    assert (alg.threshold, alg.window, alg.init_max_epochs) == (0.1, 10, 50)


def test_layers_group_float_tensors_by_module_and_leave_out_batchnorm_statistics():
    params = {
        "body.conv.weight": torch.zeros(2, 2), "body.conv.bias": torch.zeros(2),
        "body.bn.weight": torch.zeros(2), "body.bn.running_mean": torch.zeros(2), "body.bn.running_var": torch.ones(2),
        "body.bn.num_batches_tracked": torch.zeros((), dtype=torch.long), "head.weight": torch.zeros(3, 2),
    }  # fmt: skip
    layers = FedALA().layers(params)
    assert layers == {"body.conv": ["body.conv.weight", "body.conv.bias"], "body.bn": ["body.bn.weight"],
                      "head": ["head.weight"]}  # fmt: skip
    FedALA(p=3).setup(params, 4)  # three layers: p = 3 is fine
    with pytest.raises(ConfigError, match="p = 4 top layers"):
        FedALA(p=4).setup(params, 4)


def test_settled_needs_a_full_window_with_a_small_spread():
    flat = [1.0, 1.0, 1.0]
    assert not settled(flat[:2], window=3, threshold=0.1)  # fewer losses than the window
    assert settled(flat, window=3, threshold=0.1)
    wobbly = [0.0, 2.0, 4.0]
    spread = statistics.stdev(wobbly)  # 2.0 exactly; torch's std is the sample std, as here
    assert not settled(wobbly, window=3, threshold=spread)  # strictly below the threshold
    assert settled(wobbly, window=3, threshold=spread + 1e-3)
    assert settled([9.0, *flat], window=3, threshold=0.1)  # only the last window counts


D_IN = 3


NAMES = ("head.weight", "head.bias")


class TinyLinear(nn.Module):
    """One linear layer that accepts the ``side`` keyword ``ClientContext.forward`` passes."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(D_IN, 1, dtype=torch.float64)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.head(x)


def problem(n: int, seed: int = 0) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Data (n rows), the global model Θ, the local model θ and W (strictly inside (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(n, 1, generator=g, dtype=torch.float64)
    glob = {"head.weight": torch.randn(1, D_IN, generator=g, dtype=torch.float64),
            "head.bias": torch.randn(1, generator=g, dtype=torch.float64)}  # fmt: skip
    local = {k: v + torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()}
    weights = {k: 0.3 + 0.4 * torch.rand(v.shape, generator=g, dtype=torch.float64) for k, v in glob.items()}
    return x, y, glob, local, weights


def context(x: Tensor, y: Tensor, batch_size: int, seed: int = 5) -> ClientContext:
    opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=batch_size)
    return client_context(TinyLinear(), x, y, optimizer=opt, loss=F.mse_loss, generator=make_generator(seed, "ala", 0))


def reference(
    x: Tensor, y: Tensor, glob: dict, local: dict, weights: dict, s: float, eta: float, bs: int,
    generator: torch.Generator, epochs: int = 1,
) -> dict[str, Tensor]:  # fmt: skip
    """The ALA rule above, with ∂MSE/∂w = 2/B (ŷ − y)ᵀ x and ∂MSE/∂b = 2/B Σ (ŷ − y)."""
    n = x.shape[0]
    k = max(1, int(s / 100 * n))
    rows = torch.randperm(n, generator=generator)[:k]
    xs, ys = x[rows], y[rows]
    gap = {n_: glob[n_] - local[n_] for n_ in NAMES}
    w = {n_: weights[n_].clone() for n_ in NAMES}
    for _ in range(epochs):
        perm = torch.randperm(k, generator=generator)
        for start in range(0, k, bs):
            idx = perm[start : start + bs]
            xb, yb = xs[idx], ys[idx]
            mixed = {n_: local[n_] + gap[n_] * w[n_] for n_ in NAMES}
            residual = xb @ mixed["head.weight"].T + mixed["head.bias"] - yb  # [B, 1]
            grad = {"head.weight": 2.0 / len(idx) * residual.T @ xb, "head.bias": 2.0 / len(idx) * residual.sum(0)}
            w = {n_: (w[n_] - eta * grad[n_] * gap[n_]).clamp(0.0, 1.0) for n_ in NAMES}
    return w


def run(n: int, s: float, eta: float, bs: int) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """(W from learn_weights, W from the reference, W at the start) for one epoch of ALA."""
    x, y, glob, local, weights = problem(n)
    ctx = context(x, y, bs)
    twin = torch.Generator()
    twin.set_state(ctx.generator.get_state())
    torch.manual_seed(1234)  # the global RNG differs from the client's generator
    got = FedALA(s=s, eta=eta).learn_weights(ctx, glob, local, dict(weights), until_converged=False)
    return got, reference(x, y, glob, local, weights, s, eta, bs, twin), weights


def test_minibatches_over_the_sample_in_the_generators_order_with_the_clip_at_zero():
    """6 of 10 rows (s = 60 %) in 3 minibatches of 2 (3 features, so a loop over features would take 2), a large
    η so that some weights hit the clip at 0 and some at 1."""
    got, want, start = run(n=10, s=60.0, eta=5.0, bs=2)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
    flat = torch.cat([want[name].flatten() for name in NAMES])
    assert (flat == 0.0).any() and (flat == 1.0).any()  # both ends of the clip are exercised
    assert not torch.equal(flat, torch.cat([start[name].flatten() for name in NAMES]))


def test_a_small_percentage_still_takes_exactly_one_row():
    """s = 15 % of 10 rows is ⌊1.5⌋ = 1 row: one minibatch of one row, not two."""
    got, want, start = run(n=10, s=15.0, eta=0.05, bs=4)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
        assert not torch.equal(want[name], start[name])


def test_a_one_row_client_learns_from_its_row():
    got, want, start = run(n=1, s=80.0, eta=0.05, bs=4)
    for name in NAMES:
        assert_close_finite(got[name], want[name], msg=name)
        assert not torch.equal(want[name], start[name])


def test_a_client_without_rows_keeps_its_weights():
    x, y, glob, local, weights = problem(0)
    got = FedALA().learn_weights(context(x, y, 4), glob, local, weights, until_converged=True)
    for name in NAMES:
        assert torch.equal(got[name], weights[name])


def test_initial_state_of_a_bias_free_top_layer_lives_on_the_models_device():
    """A top layer with one tensor (a bias-free head): θ_i = Θ, W_i = 1 and the round counter 0, all on the model's
    device (``meta`` here, so a counter made on the default device would show)."""
    params = {"body.weight": torch.randn(4, 3), "head.weight": torch.randn(2, 4)}
    state = FedALA(p=1).init_client_state(params)
    assert sorted(state) == ["ala_runs", "ala_w.head.weight", "local.head.weight"]
    assert torch.equal(state["local.head.weight"], params["head.weight"])
    assert torch.equal(state["ala_w.head.weight"], torch.ones(2, 4))
    assert state["ala_runs"].shape == () and state["ala_runs"].dtype == torch.long and int(state["ala_runs"]) == 0
    on_meta = FedALA(p=1).init_client_state({n: t.to("meta") for n, t in params.items()})
    assert on_meta["ala_runs"].device.type == "meta" and on_meta["ala_w.head.weight"].device.type == "meta"
