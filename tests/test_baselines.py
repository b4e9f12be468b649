"""Table 1 baselines: each client (and server) update against a small independent reference.

The references are written out here in plain torch on a tiny tanh network, with full-batch steps
(batch size ≥ the client's samples, so the order of samples does not matter) and the runs' momentum 0.5
(``HeavyBall`` writes torch's SGD update out). Per-FedAvg's minibatches are rebuilt from the shuffle's
definition (one ``randperm`` of the client's samples per epoch, cut into batches of 8 + 2).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import make_trainer
from helpers import assert_close_finite
from torch import nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import APFL, L2GD, SCAFFOLD, Ditto, FedMTL, FedProx, PerFedAvg
from fl_lightning.client import ClientContext, ClientOptimizer
from fl_lightning.engine.module import FederatedModule, FineTune
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel

NAMES = ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
LR, MOM = 0.1, 0.5


def ref_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The tiny network written out by hand: softmax regression on tanh(W₁x + b₁)."""
    h = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
    logits = h @ p["head.weight"].T + p["head.bias"]
    return -(logits.log_softmax(-1).gather(1, y[:, None])).mean()


def ref_grad(p, x, y) -> dict[str, torch.Tensor]:
    leaves = {n: p[n].detach().clone().requires_grad_(True) for n in NAMES}
    grads = torch.autograd.grad(ref_loss(leaves, x, y), [leaves[n] for n in NAMES])
    return dict(zip(NAMES, grads))


class HeavyBall:
    """torch.optim.SGD's step written out: d = g + wd·p (biases excluded when ``decay_bias`` is False),
    b = d at the first step and μb + d after, p ← p − lr·b."""

    def __init__(self, lr: float = LR, mu: float = MOM, wd: float = 0.0, decay_bias: bool = True) -> None:
        self.lr, self.mu, self.wd, self.decay_bias = lr, mu, wd, decay_bias
        self.buf: dict[str, torch.Tensor] = {}

    def step(self, p: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(p)
        for n in g:
            d = g[n] + (self.wd * p[n] if self.decay_bias or not n.endswith("bias") else 0.0)
            self.buf[n] = d if n not in self.buf else self.mu * self.buf[n] + d
            out[n] = p[n] - self.lr * self.buf[n]
        return out


def rand_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"body.0.weight": (3, 4), "body.0.bias": (3,), "head.weight": (2, 3), "head.bias": (2,)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}


@pytest.fixture
def setup():
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Linear(4, 3), nn.Tanh()), nn.Linear(3, 2)).double()
    assert [n for n, _ in net.named_parameters()] == NAMES
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])

    def ctx(round_idx: int = 0, lr: float = LR, budget: float = 1.0, **settings) -> ClientContext:
        opt = ClientOptimizer(**{"lr": lr, "momentum": MOM, "batch_size": 100, **settings})  # full batch
        return ClientContext(
            net, 0, x, y, None, opt, F.cross_entropy, torch.Generator().manual_seed(2), None, round_idx, 0, budget
        )

    return ctx, x, y


def close(a, b):
    for n in NAMES:
        assert_close_finite(a[n], b[n], rtol=1e-9, atol=1e-10, msg=n)


# ---- FedProx ------------------------------------------------------------------------------------------------
def test_fedprox_gradient_is_loss_gradient_plus_mu_times_distance(setup):
    ctx, x, y = setup
    glob, mu = rand_params(3), 0.7
    upd = FedProx(mu=mu, local_epochs=4).client_update(ctx(), glob, {})
    w, opt = dict(glob), HeavyBall()
    for _ in range(4):  # ∇(f + μ/2‖w − w_g‖²) = ∇f + μ(w − w_g), with momentum 0.5
        g = ref_grad(w, x, y)
        w = opt.step(w, {n: g[n] + mu * (w[n] - glob[n]) for n in NAMES})
    close(upd.upload, w)
    # μ = 0 is FedAvg; the proximal term must make a difference after the first step
    plain = FedProx(mu=0.0, local_epochs=4).client_update(ctx(), glob, {})
    assert (plain.upload["head.weight"] - upd.upload["head.weight"]).abs().max() > 1e-4


# ---- SCAFFOLD -----------------------------------------------------------------------------------------------
def scaffold_with(glob, c, num_clients=5, epochs=3):
    alg = SCAFFOLD(local_epochs=epochs)
    alg.setup(glob, num_clients=num_clients)
    for n in NAMES:
        getattr(alg, "c__" + n.replace(".", "__")).copy_(c[n])
    return alg


def scaffold_reference(glob, c, c_i, x, y, steps):
    """K momentum steps on g − c_i + c from x; c_i⁺ = c_i − c + (x − y)/(Kη) (option II)."""
    y_, opt = dict(glob), HeavyBall()
    for _ in range(steps):
        g = ref_grad(y_, x, y)
        y_ = opt.step(y_, {n: g[n] - c_i[n] + c[n] for n in NAMES})
    return y_, {n: c_i[n] - c[n] + (glob[n] - y_[n]) / (steps * LR) for n in NAMES}


def test_scaffold_control_variate_update_option_ii(setup):
    ctx, x, y = setup
    glob = rand_params(4)
    c, c_i = ({n: 0.1 * t for n, t in rand_params(s).items()} for s in (5, 6))
    alg = scaffold_with(glob, c)
    state = {"c_i." + n: c_i[n] for n in NAMES}
    upd = alg.client_update(ctx(), glob, state)

    y_, c_new = scaffold_reference(glob, c, c_i, x, y, steps=3)
    close({n: upd.upload[n] for n in NAMES}, y_)
    close({n: upd.state["c_i." + n] for n in NAMES}, c_new)
    close({n: upd.upload["delta_c." + n] for n in NAMES}, {n: c_new[n] - c_i[n] for n in NAMES})
    # the correction's sign matters: with c and c_i swapped the model moves elsewhere
    swapped, _ = scaffold_reference(glob, c_i, c, x, y, steps=3)
    assert max(float((swapped[n] - upd.upload[n]).abs().max()) for n in NAMES) > 1e-3

    # server: c ← c + (|S|/N)·mean Δc_i, |S| = the number of uploads the engine aggregated
    alg.num_aggregated = 2
    avg = {"delta_c." + n: torch.full_like(glob[n], 2.0) for n in NAMES}
    alg.server_update(dict(glob), avg, round_idx=0)
    for n in NAMES:
        assert_close_finite(alg.server_variate()[n], c[n] + 2 / 5 * 2.0)


def test_scaffold_k_counts_a_stragglers_capped_steps(setup):
    """A straggler with budget ½ of 4 full-batch epochs takes 2 steps: K = 2 in c_i⁺, not 4."""
    ctx, x, y = setup
    glob = rand_params(4)
    c, c_i = ({n: 0.1 * t for n, t in rand_params(s).items()} for s in (5, 6))
    upd = scaffold_with(glob, c, epochs=4).client_update(ctx(budget=0.5), glob, {"c_i." + n: c_i[n] for n in NAMES})
    y_, c_new = scaffold_reference(glob, c, c_i, x, y, steps=2)
    close({n: upd.upload[n] for n in NAMES}, y_)
    close({n: upd.state["c_i." + n] for n in NAMES}, c_new)


# ---- Ditto --------------------------------------------------------------------------------------------------
def test_ditto_global_and_personal_steps(setup):
    ctx, x, y = setup
    glob, v0, lam = rand_params(7), rand_params(8), 0.6
    alg = Ditto(lam=lam, local_epochs=2, personal_epochs=3)
    upd = alg.client_update(ctx(), glob, {"v." + n: v0[n] for n in NAMES})
    w, opt = dict(glob), HeavyBall()
    for _ in range(2):
        w = opt.step(w, ref_grad(w, x, y))
    v, opt = dict(v0), HeavyBall()  # a fresh optimiser for the personal model
    for _ in range(3):  # ∇(f(v) + λ/2‖v − w^t‖²), anchored at the received global model
        g = ref_grad(v, x, y)
        v = opt.step(v, {n: g[n] + lam * (v[n] - glob[n]) for n in NAMES})
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)
    close(alg.client_model(glob, upd.state), v)  # evaluated with the personal model


# ---- APFL ---------------------------------------------------------------------------------------------------
def apfl_reference(glob, v0, a, x, y, steps, wd=0.0, decay_bias=True):
    """Per step, both at the pre-step (w, v): w ← SGD(∇f(w)), v ← SGD(α∇f(αv + (1−α)w)) (chain rule)."""
    w, v = dict(glob), dict(v0)
    opt_w, opt_v = HeavyBall(wd=wd, decay_bias=decay_bias), HeavyBall(wd=wd, decay_bias=decay_bias)
    for _ in range(steps):
        mixed = {n: a * v[n] + (1 - a) * w[n] for n in NAMES}
        gw, gm = ref_grad(w, x, y), ref_grad(mixed, x, y)
        w, v = opt_w.step(w, gw), opt_v.step(v, {n: a * gm[n] for n in NAMES})
    return w, v


def test_apfl_mixed_model_and_steps(setup):
    ctx, x, y = setup
    glob, v0, a = rand_params(9), rand_params(10), 0.3
    alg = APFL(alpha=a, local_epochs=3)
    state = {"v." + n: v0[n] for n in NAMES}
    close(alg.client_model(glob, state), {n: a * v0[n] + (1 - a) * glob[n] for n in NAMES})
    upd = alg.client_update(ctx(), glob, state)
    w, v = apfl_reference(glob, v0, a, x, y, steps=3)
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)


def test_apfl_honours_decay_bias_and_the_straggler_budget(setup):
    """Weight decay 0.1 on weights only (decay_bias=False), and a straggler with budget ½ of 4 epochs: 2 steps."""
    ctx, x, y = setup
    glob, v0, a = rand_params(9), rand_params(10), 0.3
    upd = APFL(alpha=a, local_epochs=4).client_update(
        ctx(budget=0.5, weight_decay=0.1, decay_bias=False), glob, {"v." + n: v0[n] for n in NAMES}
    )
    w, v = apfl_reference(glob, v0, a, x, y, steps=2, wd=0.1, decay_bias=False)
    close(upd.upload, w)
    close({n: upd.state["v." + n] for n in NAMES}, v)


# ---- L2GD ---------------------------------------------------------------------------------------------------
def test_l2gd_branches_and_expected_update(setup):
    ctx, x, y = setup
    xbar, x0 = rand_params(11), rand_params(12)
    p, alpha, lam, n_clients = 0.9, 0.25, 1.0, 10
    alg = L2GD(p=p, alpha=alpha, lam=lam, local_epochs=1)
    alg.setup(xbar, n_clients)
    a = alpha * lam / (n_clients * (1 - p))  # ηλ with η = α/(N(1−p))
    state = {"x." + n: x0[n] for n in NAMES}
    g = ref_grad(x0, x, y)
    local = {n: x0[n] - LR * g[n] for n in NAMES}
    pulled = {n: (1 - a) * x0[n] + a * xbar[n] for n in NAMES}

    rounds, coins, total = 1000, 0, {n: torch.zeros_like(x0[n]) for n in NAMES}
    for r in range(rounds):
        upd = alg.client_update(ctx(round_idx=r), xbar, state)
        new = {n: upd.state["x." + n] for n in NAMES}
        agg = alg.aggregation_round(0, r)
        close(new, pulled if agg else local)
        close({n: upd.upload["delta_x." + n] for n in NAMES}, {n: new[n] - x0[n] for n in NAMES})
        coins += agg
        total = {n: total[n] + new[n] for n in NAMES}
    assert abs(coins / rounds - p) < 4 * math.sqrt(p * (1 - p) / rounds)
    expected = {n: (1 - p) * local[n] + p * pulled[n] for n in NAMES}  # E over the round's coin
    spread = max(float((local[n] - pulled[n]).abs().max()) for n in NAMES)
    for n in NAMES:
        err = (total[n] / rounds - expected[n]).abs().max()
        assert err <= 4 * spread * math.sqrt(p * (1 - p) / rounds), n


# ---- Per-FedAvg ---------------------------------------------------------------------------------------------
def test_perfedavg_one_step_adaptation(setup):
    ctx, x, y = setup
    w = rand_params(13)
    adapted = PerFedAvg(inner_lr=1e-4, adapt_lr=0.3).adapt_for_evaluation(ctx(), w)
    g = ref_grad(w, x, y)
    close(adapted, {n: w[n] - 0.3 * g[n] for n in NAMES})  # w − α∇f_i(w) on the client's training data
    default = PerFedAvg(inner_lr=1e-4).adapt_for_evaluation(ctx(), w)
    close(default, {n: w[n] - 1e-4 * g[n] for n in NAMES})


@pytest.mark.parametrize("first_order", [False, True])
def test_perfedavg_meta_gradient(setup, first_order):
    ctx, x, y = setup
    w, alpha = rand_params(14), 0.05
    support, target = (x[:4], y[:4]), (x[4:], y[4:])
    alg = PerFedAvg(inner_lr=alpha, first_order=first_order, hvp_delta=1e-5)
    got = alg.meta_gradient(ctx(), w, NAMES, support, target)

    g_in = ref_grad(w, *support)
    tilde = {n: w[n] - alpha * g_in[n] for n in NAMES}
    g_out = ref_grad(tilde, *target)
    if first_order:
        want = g_out
    else:  # exact Hessian-vector product of the support loss at w
        flat = torch.cat([w[n].reshape(-1) for n in NAMES])
        sizes = [w[n].numel() for n in NAMES]

        def f(z):
            parts = dict(zip(NAMES, (t.view_as(w[n]) for n, t in zip(NAMES, z.split(sizes)))))
            return ref_loss(parts, *support)

        vec = torch.cat([g_out[n].reshape(-1) for n in NAMES])
        hv = torch.autograd.functional.hvp(f, flat, vec)[1]
        hv = dict(zip(NAMES, (t.view_as(w[n]) for n, t in zip(NAMES, hv.split(sizes)))))
        want = {n: g_out[n] - alpha * hv[n] for n in NAMES}
    for n in NAMES:
        assert_close_finite(got[n], want[n], rtol=1e-6, atol=1e-8, msg=n)


def perfedavg_reference(w0, x, y, alpha, delta, epochs, seed, steps_cap=None, swap=False, wd=0.0):
    """Per-FedAvg (HF) written out: per epoch one shuffle of the client's samples cut into batches of 8 + 2; a
    batch with no target sample is skipped; D = its first 8 samples, D' = the rest (``swap``: the other way round);
    g = ∇f(w̃; D') − α[∇f(w + δg', D) − ∇f(w − δg', D)]/(2δ), w̃ = w − α∇f(w; D), g' = ∇f(w̃; D'); momentum step."""
    gen, w, opt, steps = torch.Generator().manual_seed(seed), dict(w0), HeavyBall(wd=wd, decay_bias=False), 0
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 10):
            idx = perm[i : i + 10]
            if len(idx) <= 8 or (steps_cap is not None and steps >= steps_cap):
                continue
            d, d2 = (idx[8:], idx[:8]) if swap else (idx[:8], idx[8:])
            g_in = ref_grad(w, x[d], y[d])
            g_out = ref_grad({n: w[n] - alpha * g_in[n] for n in NAMES}, x[d2], y[d2])
            plus = ref_grad({n: w[n] + delta * g_out[n] for n in NAMES}, x[d], y[d])
            minus = ref_grad({n: w[n] - delta * g_out[n] for n in NAMES}, x[d], y[d])
            w = opt.step(w, {n: g_out[n] - alpha * (plus[n] - minus[n]) / (2 * delta) for n in NAMES})
            steps += 1
    return w, steps


@pytest.mark.parametrize("n,budget", [(23, 1.0), (29, 1.0), (29, 0.5)])
def test_perfedavg_client_update_matches_a_plain_torch_meta_loop(setup, n, budget):
    """n = 23: batches 10, 10, 3 (the 3 are skipped); n = 29: 10, 10, 9 (8 support + 1 target). Momentum 0.5,
    weight decay 0.01 on weights only, 2 epochs; budget ½: a straggler stops after half of its 6 meta-steps."""
    ctx, _, _ = setup
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (n,), generator=g)
    w0, alpha = rand_params(15), 0.05
    opt = ClientOptimizer(lr=LR, momentum=MOM, batch_size=100, weight_decay=0.01, decay_bias=False)
    net = ctx().net
    client = ClientContext(
        net, 0, x, y, None, opt, F.cross_entropy, torch.Generator().manual_seed(7), step_budget=budget
    )
    upd = PerFedAvg(inner_lr=alpha, local_epochs=2).client_update(client, w0, {})
    full = 2 * (n // 10 + (n % 10 > 8))
    cap = None if budget == 1.0 else int(budget * full)
    want, steps = perfedavg_reference(w0, x, y, alpha, 1e-3, 2, seed=7, steps_cap=cap, wd=0.01)
    assert steps == (full if cap is None else cap) and upd.state == {}
    close(upd.upload, want)
    swapped, _ = perfedavg_reference(w0, x, y, alpha, 1e-3, 2, seed=7, steps_cap=cap, swap=True, wd=0.01)
    assert max(float((swapped[k] - upd.upload[k]).abs().max()) for k in NAMES) > 1e-4  # support/target matter


# ---- Fed-MTL ------------------------------------------------------------------------------------------------
def test_fedmtl_regulariser_gradient_matches_trace_form(setup):
    ctx, x, y = setup
    n_clients, j = 5, 2
    models = [rand_params(20 + i) for i in range(n_clients)]
    alg = FedMTL(local_epochs=1, reg_scale=0.01)
    alg.setup(models[0], n_clients)
    mean = {n: sum(m[n] for m in models) / n_clients for n in NAMES}

    # reference: s·(‖W‖² + tr(WΩWᵀ)) with W = [w_1 … w_N], Ω = (I − 11ᵀ/N)², gradient in client j's column
    cols = [torch.cat([m[n].reshape(-1) for n in NAMES]) for m in models]
    wj = cols[j].clone().requires_grad_(True)
    W = torch.stack([wj if i == j else c for i, c in enumerate(cols)], dim=1)
    center = torch.eye(n_clients, dtype=W.dtype) - torch.ones(n_clients, n_clients, dtype=W.dtype) / n_clients
    omega = center @ center
    reg = 0.01 * (W.pow(2).sum() + torch.trace(W @ omega @ W.T))
    (want,) = torch.autograd.grad(reg, wj)

    leaves = {n: models[j][n].clone().requires_grad_(True) for n in NAMES}
    penalty = alg.regulariser(mean, NAMES)(leaves)
    got = torch.cat([g.reshape(-1) for g in torch.autograd.grad(penalty, [leaves[n] for n in NAMES])])
    assert_close_finite(got, want)

    # the client step: full-batch SGD on f + that regulariser, starting from its own model
    upd = alg.client_update(ctx(), mean, {"w." + n: models[j][n] for n in NAMES})
    g = ref_grad(models[j], x, y)
    step = {n: models[j][n] - LR * (g[n] + 0.01 * (2 * models[j][n] + 2 * (models[j][n] - mean[n]))) for n in NAMES}
    close({n: upd.state["w." + n] for n in NAMES}, step)


# ---- end to end on digits -----------------------------------------------------------------------------------
def run_digits(algorithm, rounds=3, **module_kw):
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
    torch.manual_seed(0)
    module = FederatedModule(algorithm, DigitsMLP(hidden=(16,)), eval_every=100, eval_last=1, **module_kw)
    seen: list[set[str]] = []
    original_attach = module.attach_data

    def attach_and_observe(fed):
        original_attach(fed)
        module.ledger.observers.append(lambda r, c, t: seen.append(set(t)))

    module.attach_data = attach_and_observe
    make_trainer(rounds).fit(module, datamodule=dm)
    return module, seen


ALGORITHMS = {
    "fedprox": lambda: FedProx(mu=0.1),
    "scaffold": lambda: SCAFFOLD(),
    "ditto": lambda: Ditto(lam=0.75),
    "apfl": lambda: APFL(alpha=0.25),
    "l2gd": lambda: L2GD(p=0.5),
    "perfedavg": lambda: PerFedAvg(),
    "fedmtl": lambda: FedMTL(),
}


def poison_first_client(algorithm, round_idx):
    """The first client of the round's cohort sends NaN: the engine drops it, and it keeps its old state."""
    victim = int(ClientSampler(10, 3, 0).sample(round_idx)[0])
    original = algorithm.client_update

    def client_update(ctx, global_params, state):
        upd = original(ctx, global_params, state)
        if ctx.round == round_idx and ctx.client == victim:
            upd.upload = {n: torch.full_like(v, float("nan")) for n, v in upd.upload.items()}
        return upd

    algorithm.client_update = client_update


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_end_to_end_with_a_dropped_client_keeps_the_server_means_exact(name):
    """|S| in SCAFFOLD's, L2GD's and Fed-MTL's server steps counts the uploads the engine aggregated: with one
    client dropped for NaN, c = mean_i c_i and x̄ = mean_i x_i still hold exactly (L2GD: in its round 1, a local
    round with p = 0.5 and seed 0, since in an aggregation round from equal models every Δx_i is 0)."""
    algorithm = ALGORITHMS[name]()
    poison_first_client(algorithm, 1 if name == "l2gd" else 0)
    assert name != "l2gd" or not algorithm.aggregation_round(0, 1)
    module, seen = run_digits(algorithm, aggregation="uniform")
    assert len(seen) == 3 * 3  # 3 clients per round, 3 rounds (the poisoned upload passes the ledger first)
    acc = module.summary["final"]
    assert 0.0 <= acc <= 1.0 and module.summary["rounds"] == 3
    if isinstance(algorithm, (L2GD, FedMTL)):  # the server's global model is the population mean exactly
        for n, p in module.net.named_parameters():
            prefix = "x." if isinstance(algorithm, L2GD) else "w."
            assert_close_finite(p.detach(), module.bank.row(prefix + n).mean(0), rtol=1e-4, atol=1e-6)
    if isinstance(algorithm, SCAFFOLD):  # c = mean_i c_i (all start at 0, uniform means)
        for n, c in algorithm.server_variate().items():
            assert_close_finite(c, module.bank.row("c_i." + n).mean(0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("algorithm", [L2GD, FedMTL])
def test_methods_that_keep_an_exact_mean_refuse_weighted_aggregation(algorithm):
    with pytest.raises(ConfigError, match="needs model.aggregation: uniform"):
        run_digits(algorithm(), aggregation="num_samples")


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_finetune_moves_only_the_head_for_the_configured_epochs(executor):
    """ "+FT" against a plain-torch loop: each client copies the global model, runs 3 full-batch momentum-SGD
    epochs on the head only, and is scored on its test split; the global model is left as it was."""
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
    torch.manual_seed(0)
    lr, epochs = 0.05, 3
    module = FederatedModule(
        FedProx(mu=0.1), DigitsMLP(hidden=(16,)), lr=lr, batch_size=10_000, eval_every=100, eval_last=1,
        finetune=FineTune(epochs=epochs), executor=executor,
    )  # fmt: skip
    make_trainer(2).fit(module, datamodule=dm)
    trained = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    result = module.evaluate_clients(1, finetune=module.finetune)
    assert all(torch.equal(p, trained[n]) for n, p in module.net.named_parameters())
    assert module.summary["algorithm"] == "FedProx+FT"
    assert module.summary["final_ft"] == pytest.approx(float(result["acc_mean"]), abs=1e-12)  # "+FT" (issue 31)

    def reference(client, head_epochs, trainable=("head.",)):
        net = copy.deepcopy(module.net)
        opt = torch.optim.SGD([p for n, p in net.named_parameters() if n.startswith(trainable)], lr=lr, momentum=MOM)
        x, y = dm.federated.train.client(client)
        for _ in range(head_epochs):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        xt, yt = dm.federated.test.client(client)
        with torch.no_grad():
            out = net(xt)
        return F.cross_entropy(out, yt).item(), (out.argmax(-1) == yt).double().mean().item()

    for c in range(10):
        loss, acc = reference(c, epochs)
        assert float(result["loss_per_client"][c]) == pytest.approx(loss, rel=1e-4)
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9)
    # the checks can fail: one epoch fewer, or a body that moves too, gives another loss
    assert float(result["loss_per_client"][0]) != pytest.approx(reference(0, epochs - 1)[0], rel=1e-3)
    assert float(result["loss_per_client"][0]) != pytest.approx(reference(0, epochs, ("",))[0], rel=1e-3)


def test_scaffold_server_variate_survives_checkpoint_resume(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(SCAFFOLD(), DigitsMLP(hidden=(16,)), eval_every=100, eval_last=1, aggregation="uniform")

    def data():
        return DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)

    full = module()
    make_trainer(4).fit(full, datamodule=data())
    ckpt = ModelCheckpoint(
        dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="r{step}", auto_insert_metric_name=False
    )
    make_trainer(4, enable_checkpointing=True, callbacks=[ckpt]).fit(module(), datamodule=data())
    resumed = module()
    make_trainer(4).fit(resumed, datamodule=data(), ckpt_path=str(tmp_path / "r2.ckpt"))
    for n, c in full.algorithm.server_variate().items():
        assert c.abs().sum() > 0 and torch.equal(resumed.algorithm.server_variate()[n], c), n
    for (n, p), (_, q) in zip(resumed.net.named_parameters(), full.net.named_parameters()):
        assert torch.equal(p, q), n
