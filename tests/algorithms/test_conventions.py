"""Each algorithm's convention pinned to its authors' code (issue 31): the reductions of the local objective, the
hyper-parameter defaults in the authors' units. The references are written here from the authors' formulas (their
file is named in each test), never from our code."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import (
    APFL,
    L2GD,
    MOON,
    SCAFFOLD,
    Ditto,
    FedALA,
    FedAvg,
    FedBN,
    FedDyn,
    FedMTL,
    FedPer,
    FedProto,
    FedProx,
    FedRep,
    FedRoD,
    LGFedAvg,
    LocalOnly,
    PerFedAvg,
    PFedMe,
)
from fl_lightning.algorithms.base import RoundFacts
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.rounds import make_generator
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite

IN, FEAT, CLASSES, BATCH = 5, 8, 4, 6


def split_net() -> SplitModel:
    torch.manual_seed(3)
    return SplitModel(nn.Sequential(nn.Linear(IN, FEAT), nn.ReLU()), nn.Linear(FEAT, CLASSES)).double()


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, IN, generator=g, dtype=torch.float64), torch.tensor([0, 1, 3, 3, 0, 2])


def params_of(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in net.named_parameters()}


def context(net: nn.Module, x: Tensor, y: Tensor) -> ClientContext:
    return ClientContext(net, 0, x, y, None, ClientOptimizer(), F.cross_entropy, make_generator(0, "conv"))


# ---- FedProto: yuetan031/FedProto lib/update.py, LocalUpdate.update_weights_het ---------------------------------
def fedproto_authors_loss(net: SplitModel, x: Tensor, y: Tensor, global_protos: dict[int, Tensor], ld: float) -> Tensor:
    """Their loop: proto_new = protos.data with the global prototype put in the rows of known labels, then
    loss1 + ld · nn.MSELoss()(proto_new, protos); the MSE written out as Σ(·)² / (batch · features)."""
    protos = net.body(x)
    loss1 = F.cross_entropy(net.head(protos), y)
    proto_new = protos.detach().clone()
    for i, label in enumerate(y.tolist()):
        if label in global_protos:
            proto_new[i, :] = global_protos[label]
    loss2 = ((proto_new - protos) ** 2).sum() / (protos.shape[0] * protos.shape[1])
    assert torch.allclose(loss2, nn.MSELoss()(proto_new, protos))  # the by-hand mean is torch's default reduction
    return loss1 + loss2 * ld


def test_fedproto_lambda_is_the_authors_ld_mse_over_batch_and_features() -> None:
    net, (x, y) = split_net(), batch()
    g = torch.Generator().manual_seed(1)
    prototypes = torch.randn(CLASSES, FEAT, generator=g, dtype=torch.float64)
    counts = torch.tensor([3.0, 0.0, 2.0, 5.0], dtype=torch.float64)  # class 1 has no global prototype yet
    alg = FedProto(lam=1.0)
    alg.global_prototypes, alg.prototype_counts = prototypes, counts
    p = params_of(net)
    ours = alg.objective(context(net, x, y)).losses(p, x, y)[0].mean()  # the minibatch loss: the per-sample mean
    known = {j: prototypes[j] for j in range(CLASSES) if counts[j] > 0}
    theirs = fedproto_authors_loss(net, x, y, known, ld=1.0)
    assert_close_finite(ours.detach(), theirs.detach())
    ours_grads = torch.autograd.grad(ours, list(p.values()))
    theirs_grads = torch.autograd.grad(theirs, list(net.parameters()))
    for a, b in zip(ours_grads, theirs_grads):
        assert_close_finite(a, b)


def test_fedproto_default_lambda_is_the_authors_ld() -> None:
    assert FedProto().lam == 1.0  # lib/options.py: --ld default 1


def fedproto_authors_aggregation(client_protos: list[dict[int, list[Tensor]]]) -> dict[int, Tensor]:
    """lib/utils.py: ``agg_func`` (a client's prototype of a label: the plain mean of the features it collected for
    that label) then ``proto_aggregation`` (the global prototype: the plain mean over the clients holding the
    label, whatever their counts)."""
    local = [{label: torch.stack(feats).mean(0) for label, feats in protos.items()} for protos in client_protos]
    labels = sorted({label for protos in local for label in protos})
    return {j: torch.stack([protos[j] for protos in local if j in protos]).mean(0) for j in labels}


def test_fedproto_global_prototypes_weigh_every_holding_client_equally_by_default() -> None:
    """Three clients with unequal class counts, one full-batch epoch each (lam 0): the uploads averaged as the
    engine does (the plain mean over the cohort, ``model.aggregation: uniform``) give the authors' prototypes by
    default; ``weighting: count`` gives the count-weighted mean instead."""
    net = split_net()
    g = torch.Generator().manual_seed(5)
    labels = [torch.tensor([0, 0, 0, 0, 0, 1]), torch.tensor([0, 2, 2]), torch.tensor([1, 1, 1, 1, 2])]
    data = [(torch.randn(len(y), IN, generator=g, dtype=torch.float64), y) for y in labels]
    authors_in = []  # the features each client's single forward pass collects, per label (before its step)
    for x, y in data:
        feats = net.body(x).detach()
        authors_in.append({j: [feats[i] for i in range(len(y)) if int(y[i]) == j] for j in sorted(set(y.tolist()))})
    theirs = fedproto_authors_aggregation(authors_in)
    by_count = {  # Σ_i |D_ij| C_i^(j) / Σ_i |D_ij|: every sample of the class weighs the same
        j: torch.cat([torch.stack(c[j]) for c in authors_in if j in c]).mean(0) for j in theirs
    }
    for weighting, expected in (("client", theirs), ("count", by_count)):
        alg = FedProto(lam=0.0) if weighting == "client" else FedProto(lam=0.0, weighting=weighting)  # type: ignore[arg-type]
        alg.check_compatible(net, CLASSES)
        uploads = []
        for x, y in data:
            opt = ClientOptimizer(lr=0.1, momentum=0.0, batch_size=16)
            ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "agg"))
            uploads.append(alg.client_update(ctx, params_of(net), alg.init_client_state(params_of(net))).upload)
        averaged = {k: sum(u[k] for u in uploads) / len(uploads) for k in uploads[0]}
        alg.server_update(params_of(net), averaged, RoundFacts(0, num_aggregated=len(uploads)))
        assert sorted(j for j in range(CLASSES) if alg.known[j]) == sorted(expected)
        for j, proto in expected.items():
            assert_close_finite(alg.global_prototypes[j], proto)
    assert float((theirs[0] - by_count[0]).abs().max()) > 1e-3  # the two weightings differ on this data


# ---- MOON: QinbinLi/MOON main.py, train_net_fedcon ---------------------------------------------------------------
def moon_authors_loss(net: SplitModel, glob: SplitModel, prev: SplitModel, x: Tensor, y: Tensor, mu: float,
                      temperature: float) -> Tensor:
    """Their loop: logits = [cos(pro1, pro2), cos(pro1, pro3)] / τ, loss2 = mu · CE(logits, 0), loss1 = CE(out, y),
    every CE the batch mean of nn.CrossEntropyLoss; written out here with exp/log."""
    pro1 = net.body(x)
    with torch.no_grad():
        pro2, pro3 = glob.body(x), prev.body(x)

    def cos(a: Tensor, b: Tensor) -> Tensor:
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-8)

    logits = torch.stack([cos(pro1, pro2), cos(pro1, pro3)], 1) / temperature
    loss2 = mu * (-(logits[:, 0] - torch.log(torch.exp(logits).sum(1)))).mean()
    out = net.head(pro1)
    loss1 = (-(out[torch.arange(len(y)), y] - torch.log(torch.exp(out).sum(1)))).mean()
    return loss1 + loss2


def perturbed(net: SplitModel, seed: int) -> SplitModel:
    other = split_net()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other


def test_moon_objective_is_the_authors_batch_mean_contrastive_cross_entropy() -> None:
    net, (x, y) = split_net(), batch()
    glob, prev = perturbed(net, 1), perturbed(net, 2)
    mu, temperature = 2.5, 0.3
    alg = MOON(mu=mu, temperature=temperature)
    p = params_of(net)
    g_params = {n: t.detach() for n, t in glob.named_parameters()}
    prev_params = {n: t.detach() for n, t in prev.named_parameters()}
    ours = alg.objective(context(net, x, y), g_params, prev_params).losses(p, x, y)[0].mean()
    theirs = moon_authors_loss(net, glob, prev, x, y, mu, temperature)
    assert_close_finite(ours.detach(), theirs.detach())
    for a, b in zip(torch.autograd.grad(ours, list(p.values())), torch.autograd.grad(theirs, list(net.parameters()))):
        assert_close_finite(a, b)


def test_moon_defaults_are_the_authors_main_py_defaults() -> None:
    alg = MOON()
    assert (alg.mu, alg.temperature) == (1.0, 0.5)  # main.py: --mu default 1, --temperature default 0.5


# ---- FedBABU: jhoon-oh/FedBABU analysis.ipynb (personalisation), models/Update.py, main_fed.py --------------------
def test_fedbabu_configs_fine_tune_the_whole_model_for_five_epochs_as_the_authors_notebook() -> None:
    """analysis.ipynb: personalization_epoch = 5; one SGD optimizer over body_params and head_params at one lr."""
    import yaml

    for path in ("configs/digits/fedbabu.yaml", "configs/methods/fedbabu.yaml"):
        model = yaml.safe_load(open(path))["model"]
        for key in ("finetune", "new_client_finetune"):
            assert model[key] == {"epochs": 5, "prefixes": [""]}, (path, key)



# ---- FedProx: litian96/FedProx flearn/optimizer/pgd.py (PerturbedGradientDescent), flearn/trainers/fedbase.py ------
# ---- Ditto: litian96/ditto flearn/trainers_MTL/ditto.py (the personal step) -----------------------------------------
def random_params(seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"body.w": torch.randn(3, 4, generator=g, dtype=torch.float64),
            "head.b": torch.randn(2, generator=g, dtype=torch.float64)}  # fmt: skip


def test_fedprox_and_ditto_proximal_gradients_are_the_authors_effective_gradients() -> None:
    """FedProx's PGD step is w − lr·(∇f + μ(w − w*)); Ditto's personal step v − lr·(∇f + λ(v − w^t)): the
    gradient of the added term is μ(w − w*) per coordinate (½·μ·Σ over every parameter, nothing averaged)."""
    w, anchor = random_params(1), random_params(2)
    for alg, coef in ((FedProx(mu=0.3), 0.3), (Ditto(lam=0.75), 0.75)):
        grads = torch.func.grad(lambda p, a=alg: a.proximal(p, anchor))(w)
        for n in w:
            assert_close_finite(grads[n], coef * (w[n] - anchor[n]))


def test_ditto_personal_epoch_with_plain_sgd_is_the_authors_and_pfllibs_and_momentum_moves_it_further() -> None:
    """Issue 44's gap (one personal epoch: ours 91.4 vs PFLlib 84.9): the authors (a tf GradientDescentOptimizer
    and the hand-written step v − lr·(∇f(v) + λ(v − w^t))) and PFLlib (``PerturbedGradientDescent``, no momentum)
    take plain SGD steps; our configs train every client phase with momentum 0.5 (``model.momentum`` in
    configs/digits/base.yaml, spec 000 §3.2). With ``momentum: 0`` our personal phase is their steps exactly; with
    0.5 it is the heavy-ball recursion, which in the same number of steps moves v_i further from where it started
    (tools/ditto_side_by_side.py measures what that does to accuracy)."""
    net, (x, y) = split_net(), batch()
    lam, lr, epochs = 0.75, 0.1, 4  # full-batch epochs: one step each, so the shuffle plays no part
    alg = Ditto(lam=lam, local_epochs=1, personal_epochs=epochs)
    w_t = {n: p.detach().clone() for n, p in net.named_parameters()}
    g = torch.Generator().manual_seed(11)
    v0 = {n: t + 0.3 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in w_t.items()}
    state = {"v." + n: t for n, t in v0.items()}

    def ours(momentum: float) -> dict[str, Tensor]:
        opt = ClientOptimizer(lr=lr, momentum=momentum, batch_size=BATCH)
        ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "ditto"))
        return {n[2:]: t for n, t in alg.client_update(ctx, w_t, state).state.items()}

    def theirs(momentum: float) -> dict[str, Tensor]:
        v, buf = {n: t.clone() for n, t in v0.items()}, {}
        for _ in range(epochs):
            leaves = {n: t.clone().requires_grad_(True) for n, t in v.items()}
            loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
            for n in v:
                eff = grads[n] + lam * (v[n] - w_t[n])  # their eff_grad / d_p
                buf[n] = eff if n not in buf else momentum * buf[n] + eff
                v[n] = v[n] - lr * buf[n]
        return v

    plain, heavy = ours(0.0), ours(0.5)
    for n in v0:
        assert_close_finite(plain[n], theirs(0.0)[n])
        assert_close_finite(heavy[n], theirs(0.5)[n])

    def moved(v: dict[str, Tensor]) -> float:
        return float(sum(((v[n] - v0[n]) ** 2).sum() for n in v) ** 0.5)

    assert moved(heavy) > 1.2 * moved(plain)


# ---- pFedMe: CharlieDinh/pFedMe FLAlgorithms/optimizers/fedoptimizer.py (pFedMeOptimizer.step),
#      FLAlgorithms/users/userpFedMe.py (train) -----------------------------------------------------------------------
def test_pfedme_personal_and_local_steps_are_the_authors() -> None:
    """K steps θ ← θ − plr·(∇f(θ; D) + λ(θ − w)) (their optimizer, mu = 0), then w ← w − λ·η·(w − θ̃); one local
    round on one minibatch holding all the client's data (the CE mean does not depend on the shuffle)."""
    net, (x, y) = split_net(), batch()
    lam, plr, eta, k = 15.0, 0.09, 0.005, 5
    alg = PFedMe(lam=lam, personal_lr=plr, inner_steps=k, local_steps=1)
    w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = ClientOptimizer(lr=eta, momentum=0.0, batch_size=BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "pfedme"))
    up = alg.client_update(ctx, w0, alg.init_client_state(w0))

    theta = {n: t.clone() for n, t in w0.items()}
    for _ in range(k):
        leaves = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        theta = {n: theta[n] - plr * (g + lam * (theta[n] - w0[n])) for n, g in zip(theta, grads)}
    for n in w0:
        assert_close_finite(up.upload[n], w0[n] - lam * eta * (w0[n] - theta[n]))
        assert_close_finite(up.state["theta." + n], theta[n])


# ---- FedDyn: alpemreacar/FedDyn utils_general.py (train_feddyn_mdl), utils_methods.py (train_FedDyn) ---------------
def test_feddyn_local_step_and_state_are_the_authors() -> None:
    """Their local loss L_i(θ) + α⟨θ, −θ^{t−1} + λ_i⟩ with SGD weight decay α (so + α/2‖θ‖²), λ_i = Σ of the
    client's past Δθ_i; after training λ_i += θ_i − θ^{t−1}. Ours keeps g_i = −α·λ_i: the same step and state."""
    net, (x, y) = split_net(), batch()
    alpha, lr = 0.1, 0.2
    theta0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = FedDyn(alpha=alpha)
    alg.check_compatible(net, CLASSES)
    alg.setup(theta0, 4)
    past = random_like(theta0, 5)  # λ_i
    state = {"grad." + n: -alpha * past[n] for n in theta0}
    opt = ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "feddyn"))
    up = alg.client_update(ctx, theta0, state)

    leaves = {n: t.clone().requires_grad_(True) for n, t in theta0.items()}
    loss_f = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
    loss_algo = alpha * sum((leaves[n] * (-theta0[n] + past[n])).sum() for n in leaves)
    grads = torch.autograd.grad(loss_f + loss_algo, list(leaves.values()))
    theta1 = {n: theta0[n] - lr * (g + alpha * theta0[n]) for n, g in zip(theta0, grads)}  # + weight decay α·θ
    for n in theta0:
        assert_close_finite(up.upload["delta." + n], theta1[n] - theta0[n])
        assert_close_finite(up.state["grad." + n], -alpha * (past[n] + theta1[n] - theta0[n]))


def random_like(params: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in params.items()}


# ---- FedBN: med-air/FedBN federated/fed_digits.py (communication) ---------------------------------------------------
def test_fedbn_keeps_local_exactly_the_keys_the_authors_do_not_average() -> None:
    """Their server averages every state_dict key without 'bn' in its name (their BN layers are named bn*): BN
    weight, bias, running mean/var and batch count stay local. Ours finds the BN layers by their buffers."""
    from fl_lightning.models import DigitsCNN

    net = DigitsCNN(batchnorm=True)
    params = dict(net.state_dict())
    alg = FedBN()
    alg.setup(params, 4)
    ours = {k for k in params if any(k.startswith(p) for p in alg.personal)}
    assert ours == {k for k in params if "bn" in k} and len(ours) == 10


# ---- FedRep: lgcollins/FedRep models/Update.py (LocalUpdate.train), main_fedrep.py, scripts/FedRep_cifar10_2shards.sh
def test_fedrep_local_update_is_the_authors_head_then_body_loop() -> None:
    """Their loop: one SGD(momentum 0.5; weight decay 1e-4 on weights, 0 on biases) over the model; the first
    local_ep − local_rep_ep epochs train the head only, the last local_rep_ep the body only (batch-mean CE)."""
    import copy

    net, (x, y) = split_net(), batch()
    lr, head_epochs = 0.1, 3
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = FedRep(head_epochs=head_epochs, body_epochs=1)
    opt = ClientOptimizer(lr=lr, momentum=0.5, weight_decay=1e-4, batch_size=BATCH, decay_bias=False)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "fedrep"))
    up = alg.client_update(ctx, glob, alg.init_client_state(glob))

    ref = copy.deepcopy(net)
    bias_p = [p for n, p in ref.named_parameters() if "bias" in n]
    weight_p = [p for n, p in ref.named_parameters() if "bias" not in n]
    sgd = torch.optim.SGD([{"params": weight_p, "weight_decay": 1e-4}, {"params": bias_p, "weight_decay": 0}],
                          lr=lr, momentum=0.5)  # fmt: skip
    for epoch in range(head_epochs + 1):
        for name, p in ref.named_parameters():
            p.requires_grad = name.startswith("head.") == (epoch < head_epochs)
        ref.zero_grad(set_to_none=True)
        nn.CrossEntropyLoss()(ref(x), y).backward()
        sgd.step()
    final = dict(ref.named_parameters())
    assert sorted(up.upload) == ["body.0.bias", "body.0.weight"] and sorted(up.state) == ["head.bias", "head.weight"]
    for n, t in final.items():
        assert_close_finite(up.upload[n] if n.startswith("body.") else up.state[n], t.detach())


# ---- LG-FedAvg: pliang279/LG-FedAvg models/Update.py (LocalUpdate.train), main_lg.py -------------------------------
def test_lg_fedavg_trains_jointly_and_uploads_only_the_global_layers() -> None:
    """Their client: one SGD(momentum 0.5) over net.parameters() (batch-mean CE); the server averages only
    w_glob_keys (the top layers) and every client keeps its own lower layers."""
    import copy

    net, (x, y) = split_net(), batch()
    lr = 0.1
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = LGFedAvg(local_epochs=2, personal=("body.",))
    state = alg.init_client_state(glob)
    opt = ClientOptimizer(lr=lr, momentum=0.5, batch_size=BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "lg"))
    up = alg.client_update(ctx, glob, state)

    ref = copy.deepcopy(net)
    sgd = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.5)
    for _ in range(2):
        sgd.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        sgd.step()
    final = {n: p.detach() for n, p in ref.named_parameters()}
    assert sorted(up.upload) == ["head.bias", "head.weight"]  # w_glob_keys: the top layer here
    for n in up.upload:
        assert_close_finite(up.upload[n], final[n])
    for n in ("body.0.weight", "body.0.bias"):
        assert_close_finite(up.state[n], final[n])  # the local layers, trained jointly, kept on the client


def test_configs_drop_partial_batches_where_the_authors_loaders_do() -> None:
    """FedProto (lib/update.py) and MOON (utils.py get_dataloader) train on DataLoader(drop_last=True); FedBABU's
    and FedRep's loaders keep the partial batch (models/Update.py)."""
    import yaml

    for method, drop in (("fedproto", True), ("moon", True), ("fedbabu", False), ("fedrep", False)):
        for folder in ("configs/digits", "configs/methods"):
            model = yaml.safe_load(open(f"{folder}/{method}.yaml"))["model"]
            assert model.get("drop_last", False) is drop, (folder, method)


# ---- FedRoD: github.com/hongyouc/Fed-RoD holds only a README; the reference is the paper's §4.1–4.2 ---------------
def test_fedrod_generic_step_is_balanced_softmax_and_personal_step_plain_ce() -> None:
    """ℓ_BSM = −log softmax(h_G(z) + log π_i)_y moves the body and generic head; ℓ_P = −log softmax(h_G(z).detach()
    + h_P(z.detach()))_y moves the personal head; both batch means, one plain SGD step each from one forward pass."""
    net, (x, _) = split_net(), batch()
    y = torch.tensor([0, 1, 3, 3, 0, 1])  # class 2 absent: log π = −inf, it gets no gradient
    lr = 0.2
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = FedRoD(local_epochs=1)
    alg.setup(glob, 4)
    state = {"p_head." + n: 0.1 * random_like(glob, 9)[n] for n in ("head.weight", "head.bias")}
    opt = ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "fedrod"))
    up = alg.client_update(ctx, glob, state)

    leaves = {n: t.clone().requires_grad_(True) for n, t in glob.items()}
    wp, bp = (state["p_head." + n].clone().requires_grad_(True) for n in ("head.weight", "head.bias"))
    z = torch.relu(x @ leaves["body.0.weight"].T + leaves["body.0.bias"])
    generic = z @ leaves["head.weight"].T + leaves["head.bias"]
    prior = torch.bincount(y, minlength=CLASSES).double() / len(y)
    bsm = -torch.log_softmax(generic + prior.log(), 1)[torch.arange(len(y)), y].mean()
    personal = -torch.log_softmax(generic.detach() + z.detach() @ wp.T + bp, 1)[torch.arange(len(y)), y].mean()
    g_shared = torch.autograd.grad(bsm, list(leaves.values()))
    g_wp, g_bp = torch.autograd.grad(personal, [wp, bp])
    for (n, t), g in zip(glob.items(), g_shared):
        assert_close_finite(up.upload[n], t - lr * g)
    assert_close_finite(up.state["p_head.head.weight"], state["p_head.head.weight"] - lr * g_wp)
    assert_close_finite(up.state["p_head.head.bias"], state["p_head.head.bias"] - lr * g_bp)


# ---- FedALA: TsingZ0/FedALA system/utils/ALA.py (adaptive_local_aggregation) --------------------------------------
def test_fedala_weight_step_is_the_authors_clipped_update() -> None:
    """Their step per batch: W ← clamp(W − η·(∂L/∂θ̂ ⊙ (Θ − θ)), 0, 1) with θ̂ = θ + (Θ − θ) ⊙ W on the top layers,
    L the batch-mean CE of the model whose lower layers are Θ; here one batch holding every sampled row."""
    net, (x, y) = split_net(), batch()
    glob = {n: p.detach().clone() for n, p in net.named_parameters()}
    local = {n: t + 0.5 for n, t in random_like(glob, 3).items() if n.startswith("head.")}
    alg = FedALA(eta=1.5, s=100, p=1)
    alg.setup(glob, 4)
    weights = {n: torch.full_like(glob[n], 0.7) for n in local}
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(batch_size=BATCH), F.cross_entropy,
                        make_generator(0, "ala"))  # fmt: skip
    got = alg.learn_weights(ctx, glob, local, weights, until_converged=False)

    mixed = {n: (local[n] + (glob[n] - local[n]) * weights[n]).requires_grad_(True) for n in local}
    loss = F.cross_entropy(torch.func.functional_call(net, {**glob, **mixed}, (x,)), y)
    grads = dict(zip(mixed, torch.autograd.grad(loss, list(mixed.values()))))
    for n in local:
        want = torch.clamp(weights[n] - 1.5 * (grads[n] * (glob[n] - local[n])), 0, 1)
        assert_close_finite(got[n], want)


# ---- APFL: the paper's Algorithm 1 (parameter mixing); the authors' MLOPTPSU/FedTorch
#      fedtorch/comms/trainings/federated/centered/apfl.py mixes the two models' outputs instead -----------------------
def test_apfl_steps_are_the_papers_parameter_mixture() -> None:
    """w ← w − η∇f(w; ξ) and v ← v − η∇_v f(αv + (1−α)w; ξ) = v − ηα∇f(v̄; ξ), both at the pre-step (w, v)."""
    net, (x, y) = split_net(), batch()
    alpha, lr = 0.25, 0.3
    w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    v0 = {n: t + 0.2 for n, t in random_like(w0, 4).items()}
    alg = APFL(alpha=alpha)
    opt = ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH)
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "apfl"))
    up = alg.client_update(ctx, w0, {"v." + n: t for n, t in v0.items()})

    def grads_at(p: dict[str, Tensor]) -> dict[str, Tensor]:
        leaves = {n: t.clone().requires_grad_(True) for n, t in p.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    g_w = grads_at(w0)
    g_mix = grads_at({n: alpha * v0[n] + (1 - alpha) * w0[n] for n in w0})
    for n in w0:
        assert_close_finite(up.upload[n], w0[n] - lr * g_w[n])
        assert_close_finite(up.state["v." + n], v0[n] - lr * alpha * g_mix[n])


# ---- SCAFFOLD: no code released by its authors; the reference is Algorithm 1, option II ---------------------------
def test_scaffold_local_steps_and_control_variate_are_algorithm_1_option_2() -> None:
    """K steps y ← y − η(g_i(y) − c_i + c) (g the batch-mean CE gradient), then c_i⁺ = c_i − c + (x − y)/(Kη);
    uploads Δy = y − x (here: y) and Δc_i = c_i⁺ − c_i."""
    net, (x, y) = split_net(), batch()
    lr, k = 0.2, 3
    x0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = SCAFFOLD(local_epochs=k)
    alg.setup(x0, 4)
    c, c_i = random_like(x0, 6), random_like(x0, 7)
    for n, t in c.items():
        alg.server_variate()[n].copy_(t)
    opt = ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH)  # one full batch per epoch: K = epochs
    ctx = ClientContext(net, 0, x, y, None, opt, F.cross_entropy, make_generator(0, "scaffold"))
    up = alg.client_update(ctx, x0, {"c_i." + n: t for n, t in c_i.items()})

    w = {n: t.clone() for n, t in x0.items()}
    for _ in range(k):
        leaves = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
        g = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
        w = {n: w[n] - lr * (g[n] - c_i[n] + c[n]) for n in w}
    for n in x0:
        c_new = c_i[n] - c[n] + (x0[n] - w[n]) / (k * lr)
        assert_close_finite(up.upload[n], w[n])
        assert_close_finite(up.state["c_i." + n], c_new)
        assert_close_finite(up.upload["delta_c." + n], c_new - c_i[n])


# ---- Per-FedAvg: no code released by its authors; the reference is the paper's HF update (Fallah et al. 2020) -----
def test_perfedavg_meta_gradient_is_the_papers_hessian_free_step() -> None:
    """w̃ = w − α∇f(w; D), g' = ∇f(w̃; D'), g = g' − α·∇²f(w; D)·g' with the Hessian-vector product by the central
    difference [∇f(w + δg'; D) − ∇f(w − δg'; D)]/(2δ); batch-mean losses. Also ≈ the exact Hessian product."""
    net, (x, y) = split_net(), batch()
    alpha, delta = 0.05, 1e-3
    w = {n: p.detach().clone() for n, p in net.named_parameters()}
    alg = PerFedAvg(inner_lr=alpha, support=4, target=2, hvp_delta=delta)
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(), F.cross_entropy, make_generator(0, "pfa"))
    got = alg.meta_gradient(ctx, w, list(w), (x[:4], y[:4]), (x[4:], y[4:]))

    def loss(p: dict[str, Tensor], xs: Tensor, ys: Tensor) -> Tensor:
        return F.cross_entropy(torch.func.functional_call(net, p, (xs,)), ys)

    def grad_at(p: dict[str, Tensor], xs: Tensor, ys: Tensor, create_graph: bool = False) -> dict[str, Tensor]:
        leaves = {n: t.clone().requires_grad_(True) if not t.requires_grad else t for n, t in p.items()}
        return dict(zip(leaves, torch.autograd.grad(loss(leaves, xs, ys), list(leaves.values()),
                                                    create_graph=create_graph)))  # fmt: skip

    g_in = grad_at(w, x[:4], y[:4])
    g_out = grad_at({n: w[n] - alpha * g_in[n] for n in w}, x[4:], y[4:])
    plus = grad_at({n: w[n] + delta * g_out[n] for n in w}, x[:4], y[:4])
    minus = grad_at({n: w[n] - delta * g_out[n] for n in w}, x[:4], y[:4])
    leaves = {n: t.clone().requires_grad_(True) for n, t in w.items()}
    g = grad_at(leaves, x[:4], y[:4], create_graph=True)
    hvp = dict(zip(leaves, torch.autograd.grad(sum((g[n] * g_out[n]).sum() for n in w), list(leaves.values()))))
    for n in w:
        assert_close_finite(got[n], g_out[n] - alpha * (plus[n] - minus[n]) / (2 * delta))
        assert_close_finite(got[n], g_out[n] - alpha * hvp[n], rtol=1e-4, atol=1e-7)


# ---- FedAvg, FedPer, Local Only: no code released by their authors; FedAvg is McMahan et al. 2017's Algorithm 1 --
def test_fedavg_fedper_and_local_only_train_every_parameter_and_differ_in_what_they_keep() -> None:
    """E epochs of minibatch SGD on the batch-mean loss over all parameters (here E full-batch steps, plain SGD);
    FedAvg uploads the whole model, FedPer the body (its head stays on the client), Local Only nothing."""
    net, (x, y) = split_net(), batch()
    lr, epochs = 0.3, 2
    w0 = {n: p.detach().clone() for n, p in net.named_parameters()}
    w = dict(w0)
    for _ in range(epochs):
        leaves = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
        w = {n: w[n] - lr * g for n, g in zip(w, torch.autograd.grad(loss, list(leaves.values())))}
    for alg, uploaded in ((FedAvg(epochs), list(w0)), (FedPer(epochs), ["body.0.weight", "body.0.bias"]),
                          (LocalOnly(epochs), [])):  # fmt: skip
        ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH),
                            F.cross_entropy, make_generator(0, "avg"))  # fmt: skip
        up = alg.client_update(ctx, w0, alg.init_client_state(w0))
        assert sorted(up.upload) == sorted(uploaded), type(alg).__name__
        for n in w0:
            assert_close_finite(up.upload[n] if n in uploaded else up.state[n], w[n])


# ---- L2GD: as FedRep's authors run it (lgcollins/FedRep main_l2gd.py: lr = alpha / (num_users·(1 − p))) ----------
def test_l2gd_aggregation_round_is_the_codes_mixing_step() -> None:
    """An aggregation round moves x_i ← (1 − ηλ)x_i + ηλ·x̄ with η = α/(N(1 − p)); a local round trains x_i."""
    net, (x, y) = split_net(), batch()
    p, alpha, lam, n_clients = 0.9, 0.25, 1.0, 20
    glob = {n: t.detach().clone() for n, t in net.named_parameters()}
    local = {n: glob[n] + d for n, d in random_like(glob, 8).items()}
    alg = L2GD(p=p, alpha=alpha, lam=lam)
    alg.setup(glob, n_clients)
    rounds = {alg.aggregation_round(0, r): r for r in range(40)}  # one aggregation and one local round
    eta_lam = alpha / (n_clients * (1 - p)) * lam
    for aggregate, round_idx in rounds.items():
        ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(lr=0.1, momentum=0.0, batch_size=BATCH),
                            F.cross_entropy, make_generator(0, "l2"), round_idx=round_idx, seed=0)  # fmt: skip
        up = alg.client_update(ctx, glob, {"x." + n: t for n, t in local.items()})
        for n in glob:
            if aggregate:
                want = (1 - eta_lam) * local[n] + eta_lam * glob[n]
            else:
                leaves = {k: t.clone().requires_grad_(True) for k, t in local.items()}
                loss = F.cross_entropy(torch.func.functional_call(net, leaves, (x,)), y)
                want = local[n] - 0.1 * dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))[n]
            assert_close_finite(up.state["x." + n], want)
            assert_close_finite(up.upload["delta_x." + n], want - local[n])
    assert set(rounds) == {True, False}


# ---- Fed-MTL: LG-FedAvg's code as FedRep runs it (lgcollins/FedRep models/Update.py LocalUpdateMTL, main_mtl.py) --
def test_fedmtl_penalty_gradient_is_that_of_the_regulariser_with_the_centering_matrix() -> None:
    """R(W) = s·(‖W‖² + tr(W Ω Wᵀ)) with Ω = C·C, C = I − 11ᵀ/m (the matrix square: Ω = C): the gradient in client
    j's column is that of our per-client penalty s·(‖w_j‖² + ‖w_j − w̄‖²) at w̄ = mean of the columns. (The code
    writes ``omega ** 2``, an elementwise square in torch: docs/algorithms.md says where we differ.)"""
    m, scale = 4, 0.01
    g = torch.Generator().manual_seed(2)
    cols = torch.randn(5, m, generator=g, dtype=torch.float64)  # W: one flattened model per column
    c = torch.eye(m, dtype=torch.float64) - torch.ones(m, m, dtype=torch.float64) / m
    omega = c @ c
    leaf = cols.clone().requires_grad_(True)
    reg = scale * (leaf.norm() ** 2 + torch.trace(leaf @ omega @ leaf.T))
    full = torch.autograd.grad(reg, leaf)[0]
    alg = FedMTL(reg_scale=scale)
    alg.setup({"w": torch.zeros(5, dtype=torch.float64)}, m)
    mean = {"w": cols.mean(1)}
    for j in range(m):
        ours = torch.func.grad(lambda p: alg.penalty(p, mean))({"w": cols[:, j]})["w"]
        assert_close_finite(ours, full[:, j])


# ---- the project's spec algorithms (spec 000 linear, 001, 003, 004): references from the papers' / authors' formulas
def regression_ctx(x: Tensor, y: Tensor, client: int = 0, round_idx: int = 0) -> ClientContext:
    return ClientContext(nn.Identity(), client, x, y, None, ClientOptimizer(), F.mse_loss,
                         make_generator(0, "spec", client), round_idx=round_idx, seed=0)  # fmt: skip


def regression_data(seed: int, n: int, d: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


# ---- IFCA: jichan3751/ifca synthetic/train_cluster.py (train, calculate_loss_grad, gradient_update) ----------------
def test_ifca_round_is_the_authors_gradient_averaging_step_at_twice_the_lr() -> None:
    """Their round: loss_ij = nn.MSELoss()(y_i, X_iθ_j) (mean, no ½); s_ij = 1 at argmin_j loss_ij; θ_j ← θ_j −
    lr·(1/m)Σ_i s_ij ∇loss_ij. Ours: one GD step on (1/(2nᵢ))‖y − Xθ‖² per client, the k rows uploaded, averaged
    with nᵢ/N over all clients: the same step at lr_ours = 2·lr_theirs (equal nᵢ, as in their runs)."""
    from fl_lightning.algorithms import IFCA

    k, d, n, lr_theirs = 2, 3, 7, 0.05
    g = torch.Generator().manual_seed(4)
    theta = torch.randn(k, d, generator=g, dtype=torch.float64)
    clients = [regression_data(10 + i, n, d) for i in range(3)]
    clients[1] = (clients[1][0], clients[1][0] @ theta[1] + 0.01 * clients[1][1])  # client 1 fits cluster 1
    alg = IFCA(local_steps=1, lr=2 * lr_theirs)
    ups = [alg.client_update(regression_ctx(x, y, i), {"theta": theta, "assign": torch.zeros(k)}, {})
           for i, (x, y) in enumerate(clients)]  # fmt: skip
    total = sum(u.num_samples for u in ups)
    ours = sum(u.num_samples / total * u.upload["theta"] for u in ups)  # aggregation: num_samples

    new = theta.clone()
    for j in range(k):
        step = torch.zeros(d, dtype=torch.float64)
        for i, (x, y) in enumerate(clients):
            losses = [nn.MSELoss()(y, x @ theta[p]) for p in range(k)]
            if int(torch.stack(losses).argmin()) != j:
                continue
            leaf = theta[j].clone().requires_grad_(True)
            step += torch.autograd.grad(nn.MSELoss()(y, x @ leaf), leaf)[0]
            assert ups[i].state["assign"][j] == 1.0  # the evaluated model: the row the client chose
        new[j] -= lr_theirs * step / len(clients)
    assert [u.num_samples for u in ups] == [n] * 3
    assert_close_finite(ours, new)


# ---- FedAvg with local steps: spec 004 §2.2/§2.4 (C.2: τ SGD steps per client, then the average) ------------------
def test_fedavg_steps_counts_tau_minibatch_steps_on_the_batch_mean_loss() -> None:
    """τ plain SGD steps (here each a full batch) on the batch-mean CE over every parameter, the whole model uploaded
    with weight nᵢ: τ = 3 steps, not 3 epochs of several steps, and not a sum over the batch."""
    from fl_lightning.algorithms import FedAvgSteps

    net, (x, y) = split_net(), batch()
    lr, tau = 0.3, 3
    w = {n: p.detach().clone() for n, p in net.named_parameters()}
    w0 = dict(w)
    for _ in range(tau):
        leaves = {n: t.clone().requires_grad_(True) for n, t in w.items()}
        loss = nn.CrossEntropyLoss()(torch.func.functional_call(net, leaves, (x,)), y)
        w = {n: w[n] - lr * gr for n, gr in zip(w, torch.autograd.grad(loss, list(leaves.values())))}
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(lr=lr, momentum=0.0, batch_size=BATCH),
                        F.cross_entropy, make_generator(0, "steps"))  # fmt: skip
    up = FedAvgSteps(local_steps=tau).client_update(ctx, w0, {})
    assert sorted(up.upload) == sorted(w0) and up.num_samples == BATCH
    for n in w0:
        assert_close_finite(up.upload[n], w[n])


# ---- linear FedAvg / D-GD: spec 004 §2.1 (the paper's Algorithm 1: simultaneous GD on B and w, both averaged) ----
def test_linear_fedavg_local_steps_are_simultaneous_gd_on_the_half_mean_square_loss() -> None:
    """fᵢ(B, w) = (1/2n)Σⱼ(⟨Bw, xⱼ⟩ − yⱼ)² (samples) or ½‖Bw − θᵢ*‖² (population); τ steps B, w ← B − α∇_B f,
    w − α∇_w f at the same point; both B and w uploaded (the server's plain mean: uniform in the configs)."""
    from fl_lightning.algorithms import LinearFedAvg

    d, k, n, alpha, tau = 5, 2, 9, 0.2, 3
    x, y = regression_data(20, n, d)
    g = torch.Generator().manual_seed(21)
    b0, w0 = torch.randn(d, k, generator=g, dtype=torch.float64), torch.randn(k, generator=g, dtype=torch.float64)
    target = torch.randn(d, generator=g, dtype=torch.float64)
    glob = {"body.weight": b0.T.clone(), "head.weight": w0.reshape(1, -1).clone()}
    for gradient in ("samples", "population"):
        alg = LinearFedAvg(local_steps=tau, step_size=alpha, init="model", gradient=gradient)
        alg.targets = target[None] if gradient == "population" else None
        up = alg.client_update(regression_ctx(x, y), glob, {})
        b, w = b0.clone(), w0.clone()
        for _ in range(tau):
            bl, wl = b.clone().requires_grad_(True), w.clone().requires_grad_(True)
            f = (0.5 * ((x @ (bl @ wl) - y) ** 2).mean() if gradient == "samples"
                 else 0.5 * ((bl @ wl - target) ** 2).sum())  # fmt: skip
            gb, gw = torch.autograd.grad(f, [bl, wl])
            b, w = b - alpha * gb, w - alpha * gw
        assert_close_finite(up.upload["body.weight"], b.T)
        assert_close_finite(up.upload["head.weight"], w.reshape(1, -1))
        assert up.state == {}


def test_linear_configs_average_with_equal_weights() -> None:
    """Spec 004 Algorithm 1: B_{t+1} = (1/m)Σ B_{t,i,τ}, w_{t+1} = (1/m)Σ w_{t,i,τ} (the base the linear FedAvg /
    D-GD / FedRep configs compose with); spec 000 Algorithm 2: B̄ = (1/m)Σ Bᵢ."""
    import yaml

    for path in ("configs/representation/linear_base.yaml", "configs/synthetic_fedrep.yaml"):
        model = yaml.safe_load(open(path))["model"]
        assert model.get("aggregation") == "uniform" and model.get("server_lr", 1.0) == 1.0, path


# ---- linear FedRep: spec 000 Algorithm 2 (lgcollins/FedRep FedRep_linear_sims.ipynb) ------------------------------
def test_linear_fedrep_exact_head_body_step_and_orthonormalised_average() -> None:
    """wᵢ = argmin_w (1/2m)‖XBw − y‖² (least squares); B ← B − η∇_B with ∇_B = (1/m)Xᵀ(XBw − y)wᵀ; the server
    averages the Bᵢ (plain mean) and takes Q of its QR (positive-diagonal R); the evaluated model is B wᵢ."""
    import numpy as np

    from fl_lightning.algorithms import LinearFedRep

    d, k, m, eta = 6, 2, 10, 0.1
    g = torch.Generator().manual_seed(30)
    b0 = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
    alg = LinearFedRep(body_lr=eta)
    bodies = []
    for i in range(2):
        x, y = regression_data(31 + i, m, d)
        up = alg.client_update(regression_ctx(x, y, i), {"body.weight": b0.T.clone(), "head.weight": None},
                               {"head.weight": torch.zeros(1, k, dtype=torch.float64)})  # fmt: skip
        xn, yn, bn = x.numpy(), y.numpy(), b0.numpy()
        w = np.linalg.lstsq(xn @ bn, yn, rcond=None)[0]
        b = bn - eta * np.outer(xn.T @ (xn @ bn @ w - yn) / m, w)
        assert_close_finite(up.state["head.weight"].reshape(-1), torch.from_numpy(w))
        assert_close_finite(up.upload["body.weight"], torch.from_numpy(b.T))
        bodies.append(b)
    for sign in (1.0, -1.0):  # one of ±B̄ has a negative diagonal in LAPACK's R
        mean = sign * (bodies[0] + bodies[1]) / 2
        q, r = np.linalg.qr(mean)
        q = q * np.sign(np.diag(r))
        params = {"body.weight": torch.from_numpy(mean.T).clone()}
        alg.server_update(params, {}, RoundFacts(0, num_aggregated=1))
        assert_close_finite(params["body.weight"], torch.from_numpy(q.T))


# ---- alternating GD: philipco/matrix_factorization src/algo/GradientDescent.py (AlternateGD), src/Client.py ---------
def lowrank_ctx(s: Tensor, client: int, round_idx: int) -> ClientContext:
    rows = torch.arange(s.shape[0])
    return ClientContext(nn.Identity(), client, rows, s, None, ClientOptimizer(), F.mse_loss,
                         make_generator(0, "mf", client, round_idx), round_idx=round_idx, seed=0)  # fmt: skip


def test_alternating_gd_iteration_and_init_are_the_authors_alternate_gd() -> None:
    """Their epoch: U^i ← U^i − η(U^iVᵀ − S^i)V; gradV_i = (U^iVᵀ − S^i)ᵀU^i with the new U^i; V ← V − η·Σ_i gradV_i
    (a sum over clients). Their constants: η = 9/(4Cμσ_max), D = Cμ/9, V₀ = √η σ_max D Φ_V (μ = 0.5, C = 8)."""
    import numpy as np

    from fl_lightning.algorithms import AlternatingGD

    d, r, rows = 5, 2, (3, 4)
    g = torch.Generator().manual_seed(40)
    s = [torch.randn(n, d, generator=g, dtype=torch.float64) for n in rows]
    alg = AlternatingGD(sigma_rounds=1)
    params = {"V": torch.zeros(d, r, dtype=torch.float64), "U": torch.zeros(4, r, dtype=torch.float64)}
    alg.setup(params, len(rows))
    state = alg.init_client_state(params)
    ups = [alg.client_update(lowrank_ctx(si, i, 0), params, state) for i, si in enumerate(s)]
    v0 = alg.power_vec.clone()
    power = {"power": sum(u.upload["power"] for u in ups) / len(ups)}  # weights 1 each
    alg.server_update(params, power, RoundFacts(0, num_aggregated=len(ups)))
    sigma = float(np.linalg.norm(sum(si.numpy().T @ si.numpy() @ v0.numpy() for si in s))) ** 0.5
    eta, dd = 9 / (4 * 8 * 0.5 * sigma), 8 * 0.5 / 9
    assert np.isclose(float(alg.eta), eta) and np.isclose(float(alg.sigma), sigma)
    assert_close_finite(params["V"], eta**0.5 * sigma * dd * alg.phi_v)

    v = params["V"].clone() + 0.1 * torch.randn(d, r, generator=g, dtype=torch.float64)
    params["V"].copy_(v)
    us = [torch.randn(n, r, generator=g, dtype=torch.float64) for n in rows]
    grads, want_u = [], []
    for i, si in enumerate(s):
        padded = torch.zeros(4, r, dtype=torch.float64)
        padded[: rows[i]] = us[i]
        up = alg.client_update(lowrank_ctx(si, i, 2), params, {"U": padded})
        un = us[i].numpy() - eta * (us[i].numpy() @ v.numpy().T - si.numpy()) @ v.numpy()
        want_u.append(un)
        grads.append((un @ v.numpy().T - si.numpy()).T @ un)
        assert_close_finite(up.state["U"][: rows[i]], torch.from_numpy(un))
        assert_close_finite(up.upload["grad_V"], torch.from_numpy(grads[-1]))
        assert up.num_samples == 1
    averaged = {"grad_V": torch.from_numpy(sum(grads) / len(grads))}
    alg.server_update(params, averaged, RoundFacts(2, num_aggregated=len(grads)))
    assert_close_finite(params["V"], v - eta * torch.from_numpy(sum(grads)))


# ---- power initialisation + local GD on U: philipco/matrix_factorization src/algo/MFInitialization.py
#      (distributed_power_initialization_for_GD_on_U), src/algo/GradientDescent.py (GD_ON_U) ----------------------
def test_power_init_is_the_sum_of_client_sketches_and_local_gd_uses_one_over_sigma_max_squared() -> None:
    """Their V = Σ_i S^iᵀΦ^i, then α times V ← Σ_i S^iᵀS^iV (sums, no normalisation) = (SᵀS)^α SᵀΦ; then each
    client U ← U − γ(UVᵀ − S^i)V with γ = 1/σ_max(V)² (no communication); F = ½‖S − UVᵀ‖²_F."""
    import numpy as np

    from fl_lightning.algorithms import PowerInitLocalGD

    d, r, rows, alpha = 5, 2, (3, 4), 1
    g = torch.Generator().manual_seed(41)
    s = [torch.randn(n, d, generator=g, dtype=torch.float64) for n in rows]
    alg = PowerInitLocalGD(alpha=alpha, local_steps=1)
    params = {"V": torch.zeros(d, r, dtype=torch.float64), "U": torch.zeros(4, r, dtype=torch.float64)}
    alg.setup(params, len(rows))
    state = alg.init_client_state(params)
    phis = [torch.randn(1, n, r, generator=make_generator(0, "mf", i, 0), dtype=torch.float64)[0].numpy()
            for i, n in enumerate(rows)]  # each client's own Gaussian Φ^i  # fmt: skip
    for round_idx in range(alpha + 1):
        ups = [alg.client_update(lowrank_ctx(si, i, round_idx), params, state) for i, si in enumerate(s)]
        assert [u.num_samples for u in ups] == [1, 1]
        sketch = {"sketch": sum(u.upload["sketch"] for u in ups) / len(ups)}
        alg.server_update(params, sketch, RoundFacts(round_idx, num_aggregated=len(ups)))
    big_s, phi = np.concatenate([si.numpy() for si in s]), np.concatenate(phis)
    v = np.linalg.matrix_power(big_s.T @ big_s, alpha) @ big_s.T @ phi
    assert_close_finite(params["V"], torch.from_numpy(v))

    u0 = torch.randn(4, r, generator=g, dtype=torch.float64)
    up = alg.client_update(lowrank_ctx(s[1], 1, alpha + 2), params, {"U": u0, "Y": u0})
    gamma = 1 / np.linalg.norm(v, 2) ** 2
    u1 = u0.numpy() - gamma * (u0.numpy() @ v.T - s[1].numpy()) @ v
    assert_close_finite(up.state["U"], torch.from_numpy(u1))
    assert np.isclose(up.loss, 0.5 * np.linalg.norm(s[1].numpy() - u1 @ v.T) ** 2)


# ---- moment descent (FedMD): the paper of spec 001, §2.1 steps 9–15 and eq. (2) (no code released) ----------------
def md_residuals(x: Tensor, y: Tensor, theta: Tensor) -> list[Tensor]:
    return [(y[j] - x[j] @ theta) * x[j] for j in range(len(y))]  # e(x, y, θ) = (y − xᵀθ)x


def test_fedmd_moment_is_the_n_weighted_pair_sum_and_the_anchor_step_eq_2() -> None:
    """Y_h = (Σ_i nᵢ)⁻¹ Σ_i Σ_{a≠b} e(a)e(b)ᵀ (each client uploads its pair sum / nᵢ with weight nᵢ); an anchor's
    A = (1/ℓ)Σ_pairs (Ûᵀe(a))(Ûᵀe(b))ᵀ, σ̂² = σ₁(A), β̂ its top left singular vector, θ ← θ + (α/(2β²))σ̂Ûβ̂ with
    Ûβ̂ oriented along Σe (α/(2β²) = ½)."""
    from fl_lightning.algorithms import FedMD

    k, d, rows = 2, 4, (5, 6)
    g = torch.Generator().manual_seed(50)
    theta = torch.randn(k, d, generator=g, dtype=torch.float64)
    data = [regression_data(51 + i, n, d) for i, n in enumerate(rows)]
    alg = FedMD(num_anchors=2, phase1_iters=1, anchor_min_samples=1)
    alg.setup({"theta": theta}, len(rows))
    alg.anchor_models.add_(torch.randn(2, d, generator=g, dtype=torch.float64))
    glob = {"theta": theta, "assign": torch.zeros(k)}
    ups = [alg.warmup_update(regression_ctx(x, y, i, round_idx=1), glob, {}) for i, (x, y) in enumerate(data)]
    ours = sum(u.num_samples * u.upload["moment"] for u in ups) / sum(u.num_samples for u in ups)
    for h in range(2):
        want = torch.zeros(d, d, dtype=torch.float64)
        for x, y in data:
            e = md_residuals(x, y, alg.anchor_models[h])
            want += sum(torch.outer(e[a], e[b]) for a in range(len(e)) for b in range(len(e)) if a != b)
        assert_close_finite(ours[h], want / sum(rows))

    from fl_lightning.algorithms.moment_descent import anchor_step

    x, y = data[1]
    basis = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0]
    start = alg.anchor_models[0]
    e = md_residuals(x, y, start)
    for pairing, pairs in (("disjoint", [(0, 1), (2, 3), (4, 5)]),
                           ("all", [(a, b) for a in range(6) for b in range(6) if a != b])):  # fmt: skip
        amat = sum(torch.outer(basis.T @ e[a], basis.T @ e[b]) for a, b in pairs) / len(pairs)
        u, sv, _ = torch.linalg.svd(amat)
        direction = basis @ u[:, 0]
        direction = direction if float(direction @ sum(e)) >= 0 else -direction
        moved, sigma = anchor_step(x, y, start, basis, pairing=pairing)
        assert abs(sigma - float(sv[0]) ** 0.5) < 1e-10
        assert_close_finite(moved, start + 0.5 * float(sv[0]) ** 0.5 * direction)


# ---- one-shot k-means: spec 001 §2.4 item 2 ([GHYR19]: local estimates, k-means once, FedAvg per cluster) ---------
def test_oneshot_uploads_min_norm_estimates_and_keeps_the_kmeans_labels() -> None:
    """Round 0: θ̂ᵢ = X_i⁺y_i (minimum-norm least squares, nᵢ < d); the server's k-means centres start the
    clusters and each client's label is kept afterwards (even where eq. (8)'s residual would choose another row)."""
    import numpy as np

    from fl_lightning.algorithms import OneShotClustering

    k, d, n = 2, 6, 3
    g = torch.Generator().manual_seed(60)
    centres = torch.stack([torch.full((d,), 5.0), torch.full((d,), -5.0)]).double()
    data = []
    for i in range(4):
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        data.append((x, x @ (centres[i // 2] + 0.01 * torch.randn(d, generator=g, dtype=torch.float64))))
    alg = OneShotClustering(local_steps=1, lr=0.1)
    theta = torch.zeros(k, d, dtype=torch.float64)
    alg.setup({"theta": theta}, 4)
    glob = {"theta": theta, "assign": torch.zeros(k)}
    ups = [alg.client_update(regression_ctx(x, y, i), glob, {}) for i, (x, y) in enumerate(data)]
    estimates = [np.linalg.lstsq(x.numpy(), y.numpy(), rcond=None)[0] for x, y in data]  # min-norm for n < d
    for i, up in enumerate(ups):
        assert_close_finite(up.upload["estimates"][i], torch.from_numpy(estimates[i]))
    total = sum(u.num_samples for u in ups)
    averaged = {key: sum(u.num_samples / total * u.upload[key] for u in ups) for key in ("estimates", "estimate_mask")}
    params = {"theta": theta.clone()}
    alg.server_update(params, averaged, RoundFacts(0, num_aggregated=len(ups)))
    means = [np.mean(estimates[:2], 0), np.mean(estimates[2:], 0)]  # well separated: k-means = the group means
    got = sorted(params["theta"].numpy().tolist())
    assert np.allclose(got, sorted(m.tolist() for m in means)) and np.isfinite(got).all()
    labels = alg.labels.tolist()
    assert labels[0] == labels[1] != labels[2] == labels[3]
    swapped = {"theta": params["theta"].flip(0), "assign": torch.zeros(k)}  # eq. (8) would now pick the other row
    up = alg.client_update(regression_ctx(*data[0], 0, round_idx=1), swapped, {})
    assert int(up.state["assign"].argmax()) == labels[0]
