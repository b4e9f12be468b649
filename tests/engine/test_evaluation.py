"""``fl_lightning/engine/evaluation.py``: client evaluation against plain-torch references, its chunks, the "+FT"
fine-tuning of the heads, and new clients evaluated through the held-out client path."""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedProto, FedProx, FedRep, PerFedAvg, PFedMe
from fl_lightning.client import Params, select
from fl_lightning.engine import evaluation
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.evaluation import (
    ClientChunks,
    ClientEvaluation,
    FineTune,
    _finetune_heads,
    check_monitored_keys,
    client_chunks,
    score_outputs,
    shared_body_applies,
    validation_metric_names,
    validation_metrics,
)
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import PerClientScores
from fl_lightning.models import DigitsMLP, LinearRepresentation
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.functional_mlp import MOM
from tests.helpers.round_references import (
    FULL_BATCH,
    LR,
    MOMENTUM,
    fedproto_train,
    model_with,
    nearest_prototype_accuracy,
    params_of,
)
from tests.helpers.small_modules import digits_fed, make_module, regression_fed
from tests.helpers.stand_ins import with_trainer
from tests.helpers.training import fit, make_trainer

# ---- validation_metric_names and check_monitored_keys -----------------------------------------------------
CLASSIFICATION_NAMES = {
    "val/acc_mean",
    "val/acc_last10",
    "val/acc_std",
    "val/acc_worst10",
    "val/acc_min",
    "val/acc_weighted",
    "val/loss",
}


REGRESSION_NAMES = {"val/mse_mean", "val/mse_last10", "val/mse_std", "val/mse_worst10", "val/mse_max"}


def test_validation_metric_names_classification() -> None:
    module = make_module()
    module.fed = digits_fed()
    assert validation_metric_names(module.fed, module.net) == CLASSIFICATION_NAMES


def test_validation_metric_names_regression() -> None:
    module = FederatedModule(FedAvg(1), nn.Linear(4, 1))
    module.fed = regression_fed()
    assert validation_metric_names(module.fed, module.net) == REGRESSION_NAMES


def test_dist_b_needs_both_b_star_and_a_representation() -> None:
    b_star = torch.eye(4)[:, :2]
    with_rep = FederatedModule(FedAvg(1), LinearRepresentation(dim=4, rank=2))
    with_rep.fed = regression_fed({"B_star": b_star})
    assert validation_metric_names(with_rep.fed, with_rep.net) == REGRESSION_NAMES | {"val/dist_B"}
    with_rep.fed = regression_fed()  # a representation but no ground truth
    assert validation_metric_names(with_rep.fed, with_rep.net) == REGRESSION_NAMES
    plain = FederatedModule(FedAvg(1), nn.Linear(4, 1))  # ground truth but no representation
    plain.fed = regression_fed({"B_star": b_star})
    assert validation_metric_names(plain.fed, plain.net) == REGRESSION_NAMES


def test_monitoring_a_logged_key_is_accepted() -> None:
    module = make_module()
    module.fed = digits_fed()
    callbacks = [SimpleNamespace(monitor=k) for k in sorted(CLASSIFICATION_NAMES)]
    callbacks += [SimpleNamespace(monitor="train/loss"), SimpleNamespace(monitor=None), SimpleNamespace()]
    with_trainer(module, callbacks=callbacks)
    check_monitored_keys(module.fed, module.net, module.trainer.callbacks)


@pytest.mark.parametrize("monitor", ["val/mse_mean", "val/nope"])
def test_monitoring_a_val_key_that_is_never_logged_is_refused(monitor: str) -> None:
    module = make_module()
    module.fed = digits_fed()
    with_trainer(module, callbacks=[SimpleNamespace(monitor=monitor)])
    with pytest.raises(ConfigError, match="which is never logged"):
        check_monitored_keys(module.fed, module.net, module.trainer.callbacks)


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("part", ["default", "head_only"])
def test_finetune_trains_the_configured_part_for_the_configured_epochs(executor, part):
    """ "+FT" against a plain-torch loop: each client copies the global model, runs 3 full-batch momentum-SGD
    epochs on the whole model (``FineTune``'s default, as FedBABU's authors and PFLlib fine-tune) or on the head
    only (``FineTune.head_only``), and is scored on its test split; the global model is left as it was."""
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), participation=0.3, seed=0)
    torch.manual_seed(0)
    lr, epochs = 0.05, 3
    finetune = FineTune(epochs=epochs) if part == "default" else FineTune.head_only(epochs)
    trainable, other = (("",), ("head.",)) if part == "default" else (("head.",), ("",))
    assert finetune.prefixes == trainable
    module = FederatedModule(
        FedProx(mu=0.1), DigitsMLP(hidden=(16,)), lr=lr, batch_size=10_000, eval_every=100, eval_last=1,
        finetune=finetune, executor=executor,
    )  # fmt: skip
    make_trainer(2).fit(module, datamodule=dm)
    trained = {n: p.detach().clone() for n, p in module.net.named_parameters()}
    result = module.evaluate_clients(1, finetune=module.finetune)
    assert all(torch.equal(p, trained[n]) for n, p in module.net.named_parameters())
    assert module.summary["algorithm"] == "FedProx+FT"
    assert module.summary["final_ft"] == pytest.approx(float(result["acc_mean"]), abs=1e-12)  # "+FT" (issue 31)

    def reference(client, ft_epochs, prefixes):
        net = copy.deepcopy(module.net)
        opt = torch.optim.SGD([p for n, p in net.named_parameters() if n.startswith(prefixes)], lr=lr, momentum=MOM)
        x, y = dm.federated.train.client(client)
        for _ in range(ft_epochs):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        xt, yt = dm.federated.test.client(client)
        with torch.no_grad():
            out = net(xt)
        return F.cross_entropy(out, yt).item(), (out.argmax(-1) == yt).double().mean().item()

    for c in range(10):
        loss, acc = reference(c, epochs, trainable)
        assert float(result["loss_per_client"][c]) == pytest.approx(loss, rel=1e-4)
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9)
    # the checks can fail: one epoch fewer, or the other part (a body that moves too, or a frozen body), gives
    # another loss
    assert float(result["loss_per_client"][0]) != pytest.approx(reference(0, epochs - 1, trainable)[0], rel=1e-3)
    assert float(result["loss_per_client"][0]) != pytest.approx(reference(0, epochs, other)[0], rel=1e-3)


def test_finetune_default_is_the_whole_model_in_a_config():
    """``model.finetune: {epochs: 2}`` (no ``prefixes``) parses to whole-model fine-tuning; ``prefixes: [head.]``
    keeps the head only."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--finetune", type=FineTune | None, default=None)

    def parsed(value: str) -> FineTune:
        return parser.instantiate_classes(parser.parse_args(["--finetune", value])).finetune

    assert parsed('{"epochs": 2}') == FineTune(2, ("",))
    assert parsed('{"epochs": 2, "prefixes": ["head."]}') == FineTune.head_only(2) == FineTune(2, ("head.",))


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


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_new_clients_are_evaluated_on_their_own_data_and_the_runs_data_stays(
    executor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluate_new_clients`` hands the held-out clients' data to the evaluation instead of swapping the run's:
    ``module.fed`` and ``module.client_scores`` are the same objects while every new client's context is built and
    afterwards, holding the same values. Each new client's numbers are a plain-torch "+FT" here: FedAvg keeps no
    personal state, so a new client starts from the global model and fine-tunes its head for 3 full-batch heavy-ball
    epochs on its own training rows (on both paths: the loop's contexts and the stacked heads of
    ``_finetune_heads``)."""
    torch.manual_seed(0)
    module = FederatedModule(
        FedAvg(), DigitsMLP(hidden=(16,)), lr=LR, momentum=MOMENTUM, batch_size=FULL_BATCH, eval_every=1,
        new_client_finetune=FineTune(epochs=3, prefixes=("head.",)), executor=executor,
    )  # fmt: skip
    fit(module, DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=4, seed=0), rounds=2)
    new = DigitsDataModule(num_clients=5, partition=Shards(2), seed=7)
    new.setup()
    fed, scores = module.fed, module.client_scores
    train_x, test_y = fed.train.x.clone(), fed.test.y.clone()
    before = {k: getattr(scores, k).clone() for k in ("correct", "total", "loss_sum")}
    assert float(before["total"].sum()) > 0  # the run's last evaluation is in them

    seen: list[bool] = []  # at every context built for a new client: the run still holds its own data and scores

    def spy(build: Callable) -> Callable:
        def built(run: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(run.fed is fed and run.client_scores is scores and kwargs.get("fed") is not fed)
            return build(run, *args, **kwargs)

        return built

    monkeypatch.setattr(evaluation, "client_context", spy(evaluation.client_context))
    monkeypatch.setattr(evaluation, "vector_context", spy(evaluation.vector_context))
    result = module.evaluate_new_clients(1, new.federated)
    assert seen and all(seen)

    assert module.fed is fed and module.client_scores is scores
    assert fed.num_clients == 10 and torch.equal(fed.train.x, train_x) and torch.equal(fed.test.y, test_y)
    for k, v in before.items():
        assert torch.equal(getattr(scores, k), v), k
    glob = {n: t.detach().clone().double() for n, t in module.global_params().items()}
    head = ["head.weight", "head.bias"]

    def forward(p: dict[str, Tensor], x: Tensor) -> Tensor:
        hidden = torch.relu(x.flatten(1).double() @ p["body.fc1.weight"].T + p["body.fc1.bias"])
        return hidden @ p["head.weight"].T + p["head.bias"]

    for c in range(5):
        x, y = new.federated.train.client(c)
        p, buf = dict(glob), {}
        for _ in range(3):  # torch.optim.SGD(momentum) written out, full batch
            q = {**p, **{n: p[n].clone().requires_grad_(True) for n in head}}
            g = dict(zip(head, torch.autograd.grad(F.cross_entropy(forward(q, x), y), [q[n] for n in head])))
            for n in head:
                buf[n] = g[n] if n not in buf else MOMENTUM * buf[n] + g[n]
                p[n] = p[n] - LR * buf[n]
        xt, yt = new.federated.test.client(c)
        logits = forward(p, xt)
        acc = float((logits.argmax(-1) == yt).double().mean())
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9), c
        assert float(result["loss_per_client"][c]) == pytest.approx(float(F.cross_entropy(logits, yt)), rel=1e-4), c


class _Context:
    def __init__(self, clients: list[int], calls: list[dict]) -> None:
        self.clients, self.calls = clients, calls

    def params_with(self, prefixes: tuple[str, ...]) -> list[str]:
        return select(["body.w", "head.w", "head.b"], prefixes)

    def sgd(self, params: Params, trainable: list[str], epochs: int) -> Params:
        k = len(self.clients)
        assert k > 0
        assert all(v.shape[0] == k for v in params.values())
        self.calls.append({"clients": list(self.clients), "trainable": list(trainable), "epochs": epochs})
        ids = torch.tensor(self.clients, dtype=torch.float64)
        return {n: (2 * v + ids.view(-1, *([1] * (v.dim() - 1))) if n in trainable else v) for n, v in params.items()}


class _Module:
    def __init__(self) -> None:
        self.net = nn.Linear(1, 1)
        self.calls: list[dict] = []
        self.evaluated = SimpleNamespace(name="the evaluated clients' data")  #: what ``_finetune_heads`` is handed

    def vector_context(
        self, clients: list[int], round_idx: int, budgets: list[float], tag: str = "train", fed: Any = None
    ) -> _Context:
        assert tag == "evaluation" and round_idx == 4 and len(budgets) == len(clients)
        assert fed is self.evaluated  # the contexts are built on the data being evaluated, not the run's
        return _Context(clients, self.calls)


def _heads(clients: list[int]) -> list[Params]:
    return [
        {
            "head.w": torch.tensor([[0.5 * j, -1.0]], dtype=torch.float64),
            "head.b": torch.tensor([j - 0.25], dtype=torch.float64),
        }
        for j, _ in enumerate(clients)
    ]


def _glob() -> dict[str, Tensor]:
    return {
        "body.w": torch.tensor([3.0], dtype=torch.float64),
        "head.w": torch.tensor([[100.0, 100.0]], dtype=torch.float64),
        "head.b": torch.tensor([100.0], dtype=torch.float64),
    }


def _check(clients: list[int]) -> _Module:
    module, heads = _Module(), _heads(clients)
    out = _finetune_heads(module, clients, _glob(), heads, 4, FineTune(epochs=3, prefixes=("head.",)), module.evaluated)
    assert len(out) == len(clients)
    for k, c in enumerate(clients):
        assert sorted(out[k]) == ["head.b", "head.w"]
        for n in ("head.w", "head.b"):
            assert_close_finite(out[k][n], 2 * heads[k][n] + c, msg=f"client {c} {n}")
    return module


@pytest.mark.usefixtures("_stand_in_contexts")
def test_finetune_heads_chunks_300_clients_as_256_then_44_and_keeps_each_clients_head() -> None:
    """300 clients: two chunks (256 and 44, in order), the head names trained for the configured epochs, and
    every client's tuned head is its own head's."""
    clients = [3 * j + 1 for j in range(300)]
    module = _check(clients)
    assert [c["clients"] for c in module.calls] == [clients[:256], clients[256:]]
    assert all(c["trainable"] == ["head.w", "head.b"] and c["epochs"] == 3 for c in module.calls)


@pytest.mark.usefixtures("_stand_in_contexts")
def test_finetune_heads_single_and_few_clients() -> None:
    """One client and three clients: a single chunk each, one result per client."""
    for clients in ([7], [5, 0, 9]):
        module = _check(clients)
        assert [c["clients"] for c in module.calls] == [clients]


Params_2 = dict[str, Tensor]


SEED, ROUND, LR_2, BS = 11, 7, 0.5, 2


TRAIN_SIZES, TEST_SIZES, VAL_SIZES = [6, 6, 4], [3, 4, 2], [2, 3, 2]


def _split(sizes: list[int], gen: torch.Generator) -> ClientSplit:
    n = sum(sizes)
    ptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    return ClientSplit(
        torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen), ptr
    )


def _fed() -> FederatedData:
    gen = torch.Generator().manual_seed(3)
    train, test, val = _split(TRAIN_SIZES, gen), _split(TEST_SIZES, gen), _split(VAL_SIZES, gen)
    return FederatedData(train, test, 3, seed=SEED, val=val)


def _module(algorithm: FedAvg, executor: str = "sequential") -> FederatedModule:
    torch.manual_seed(0)
    net = SplitModel(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3)).double()
    module = FederatedModule(algorithm, net, lr=LR_2, momentum=0.0, batch_size=BS, executor=executor)
    module.attach_data(_fed())
    return module


def _heads_2(module: FederatedModule) -> list[Params_2]:
    """Every client's own head: the global head shifted by a client-specific amount."""
    glob = module.global_params()
    return [
        {
            "head.weight": glob["head.weight"] + 0.4 * (c - 1) * torch.ones_like(glob["head.weight"]).tril(),
            "head.bias": glob["head.bias"] + torch.tensor([0.3 * c, -0.2, 0.1 * c], dtype=torch.float64),
        }
        for c in range(3)
    ]


def _forward(p: Params_2, x: Tensor) -> Tensor:
    h = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
    return h @ p["head.weight"].T + p["head.bias"]


def _evaluation_stream(client: int) -> torch.Generator:
    """The client's evaluation generator of round ``ROUND``, seeded by the reference derivation."""
    digest = hashlib.blake2b(repr((SEED, "evaluation", ROUND, client)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)


def _reference_finetune(p: Params_2, x: Tensor, y: Tensor, client: int, names: list[str]) -> Params_2:
    """One epoch of plain SGD (lr 0.5, mean cross-entropy of each batch of 2) on ``names``."""
    p = {n: v.clone() for n, v in p.items()}
    perm = torch.randperm(x.shape[0], generator=_evaluation_stream(client))
    for i in range(0, x.shape[0], BS):
        idx = perm[i : i + BS]
        leaves = {n: p[n].detach().requires_grad_(True) for n in names}
        loss = F.cross_entropy(_forward({**p, **leaves}, x[idx]), y[idx])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for n, g in zip(names, grads):
            p[n] = (p[n] - LR_2 * g).detach()
    return p


def _reference_scores(
    module: FederatedModule, heads: list[Params_2], split: str, tune: list[str] | None = None,
    transform: Callable[[Tensor], Tensor] = lambda out: out,
) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    """(correct, samples, summed loss) of every client, computed by hand."""
    fed, glob = module.fed, {n: v.clone() for n, v in module.global_params().items()}
    rows = getattr(fed, split)
    correct, total, loss = [], [], []
    for c in range(3):
        p = {**glob, **heads[c]}
        if tune is not None:
            xt, yt = fed.train.client(c)
            p = _reference_finetune(p, xt, yt, c, tune)
        x, y = rows.client(c)
        out = transform(_forward(p, x))
        correct.append(float((out.argmax(1) == y).sum()))
        total.append(float(x.shape[0]))
        loss.append(float(F.cross_entropy(out, y, reduction="sum")))
    return correct, total, loss


def _evaluate(module: FederatedModule, heads: list[Params_2], **kwargs: object) -> PerClientScores:
    scores = PerClientScores(3)
    evaluation.evaluate_clients(module, [0, 1, 2], ROUND, scores, state_of=lambda c: heads[c], **kwargs)
    return scores


def _check_2(scores: PerClientScores, expected: tuple[list[float], list[float], list[float]]) -> None:
    correct, total, loss = expected
    assert scores.total.tolist() == total
    assert scores.correct.tolist() == correct
    # the loss is summed in float32 (``score_outputs``), hence the float32-level tolerance
    assert_close_finite(scores.loss_sum, torch.tensor(loss, dtype=torch.float64), rtol=1e-6, atol=1e-9)


def test_default_split_is_the_test_split() -> None:
    """Without ``split`` every client is scored on its test rows (3, 4, 2 of them; the val split has 2, 3, 2)."""
    module = _module(FedAvg(1, personal=("head.",)))
    heads = _heads_2(module)
    _check_2(_evaluate(module, heads), _reference_scores(module, heads, "test"))
    _check_2(_evaluate(module, heads, split="val"), _reference_scores(module, heads, "val"))


class _ScaledPredict(FedAvg):
    """An algorithm whose outputs are the network's logits negated and doubled (its own ``predict``)."""

    def predict(self, net: nn.Module, params: Params_2, x: Tensor, side: Tensor | None) -> Tensor:
        return -2.0 * super().predict(net, params, x, side)


def test_the_algorithms_predict_gives_the_scored_outputs() -> None:
    module = _module(_ScaledPredict(1, personal=("head.",)))
    heads = _heads_2(module)
    expected = _reference_scores(module, heads, "test", transform=lambda out: -2.0 * out)
    assert expected != _reference_scores(module, heads, "test")  # the case tells the two apart
    _check_2(_evaluate(module, heads, split="test"), expected)


class _RecordingAdapt(FedAvg):
    """Records the context each client adapts in: its client id, round and first draw of its generator."""

    def __init__(self) -> None:
        super().__init__(1, personal=("head.",))
        self.seen: list[tuple[int, int, float]] = []

    def adapt_for_evaluation(self, ctx: ClientContext, params: Params_2) -> Params_2:
        self.seen.append((ctx.client, ctx.round, float(torch.rand(1, generator=ctx.generator))))
        return params


def test_evaluation_adapts_in_the_clients_evaluation_stream_of_the_round() -> None:
    algorithm = _RecordingAdapt()
    module = _module(algorithm)
    heads = _heads_2(module)
    _check_2(_evaluate(module, heads, split="test"), _reference_scores(module, heads, "test"))
    expected = [(c, ROUND, float(torch.rand(1, generator=_evaluation_stream(c)))) for c in range(3)]
    assert algorithm.seen == expected


def test_finetune_of_the_head_client_by_client() -> None:
    """Sequential executor, "+FT" of the head: each client's head after one epoch of SGD in its evaluation
    stream's order."""
    module = _module(FedAvg(1, personal=("head.",)))
    heads = _heads_2(module)
    expected = _reference_scores(module, heads, "test", tune=["head.weight", "head.bias"])
    _check_2(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("head.",))), expected)


def test_finetune_of_the_head_on_the_shared_body_fast_path() -> None:
    """Vectorized executor (the shared-body fast path): the same fine-tuned heads as the reference."""
    module = _module(FedAvg(1, personal=("head.",)), executor="vectorized")
    assert evaluation.shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",)))
    heads = _heads_2(module)
    expected = _reference_scores(module, heads, "test", tune=["head.weight", "head.bias"])
    assert expected[2] != _reference_scores(module, heads, "test")[2]  # fine-tuning changes the losses
    _check_2(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("head.",))), expected)


def test_finetune_of_the_body_on_the_vectorized_executor_tunes_the_body() -> None:
    """Vectorized executor but "+FT" of the body: the fast path (which keeps only the heads) does not apply and
    each client is scored with its fine-tuned body."""
    module = _module(FedAvg(1, personal=("head.",)), executor="vectorized")
    heads = _heads_2(module)
    expected = _reference_scores(module, heads, "test", tune=["body.0.weight", "body.0.bias"])
    assert expected[2] != _reference_scores(module, heads, "test")[2]
    _check_2(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("body.",))), expected)


ACC = [0.5, 1.0, 0.25, 0.75]


LOSS = [1.0, 2.0, 4.0, 0.5]


# ---- client chunks ---------------------------------------------------------------------------------------------
def test_client_chunks_default_is_every_client_of_the_single_process_in_one_chunk() -> None:
    """Rank 0 of a world of 1 by default: 5 clients are one chunk of all five."""
    chunks = ClientChunks(5)
    assert len(chunks) == 1
    assert list(chunks) == [[0, 1, 2, 3, 4]]


def test_client_chunks_count_uses_this_ranks_share_of_the_clients() -> None:
    """300 clients on 2 ranks: 150 per rank fit one chunk of 256 (not 300 / 256 rounded up, not more)."""
    for rank in (0, 1):
        chunks = ClientChunks(300, rank, 2)
        assert len(chunks) == 1
        assert list(chunks) == [list(range(rank, 300, 2))]
    assert len(ClientChunks(600, 1, 2)) == 2  # 300 clients per rank: 256 + 44


def test_client_chunks_for_no_trainer_and_for_a_trainers_rank() -> None:
    """Without a trainer all clients are this process's; with one, its rank's share."""
    assert list(client_chunks(4)) == [[0, 1, 2, 3]]
    assert list(client_chunks(5, SimpleNamespace(global_rank=1, world_size=2))) == [[1, 3]]


# ---- ClientEvaluation ------------------------------------------------------------------------------------------
def _scores(with_samples: bool) -> dict[str, torch.Tensor]:
    scores = {
        "acc_per_client": torch.tensor(ACC, dtype=torch.float64),
        "loss_per_client": torch.tensor(LOSS, dtype=torch.float64),
        "acc_mean": torch.tensor(0.6, dtype=torch.float64),
        "acc_weighted": torch.tensor(0.55, dtype=torch.float64),
        "loss_mean": torch.tensor(1.5, dtype=torch.float64),
    }
    if with_samples:
        scores["samples_per_client"] = torch.tensor([2.0, 1.0, 4.0, 0.0], dtype=torch.float64)
    return scores


def test_from_scores_keeps_the_samples_per_client_when_given() -> None:
    result = ClientEvaluation.from_scores(_scores(True), 6)
    assert result.round == 6
    assert result.samples_per_client is not None
    assert result.samples_per_client.tolist() == [2.0, 1.0, 4.0, 0.0]
    assert [r["samples"] for r in result.rows()] == [2, 1, 4, 0]
    assert (result.acc_mean, result.acc_weighted, result.loss_mean) == (0.6, 0.55, 1.5)


def test_a_client_without_test_rows_has_no_accuracy_not_zero(tmp_path) -> None:
    """clients.csv: the client with 0 test samples gets empty cells (read back without the keys), not a 0 % that
    every pooled per-client plot would show as a failing client; the others keep their numbers."""
    from fl_lightning.experiment.collect import read_clients
    from fl_lightning.loggers import write_clients_csv

    rows = ClientEvaluation.from_scores(_scores(True), 6).rows()
    assert [r["accuracy"] for r in rows[:3]] == ACC[:3] and [r["loss"] for r in rows[:3]] == LOSS[:3]
    assert math.isnan(rows[3]["accuracy"]) and math.isnan(rows[3]["loss"])
    write_clients_csv(tmp_path / "clients.csv", rows)
    assert (tmp_path / "clients.csv").read_text().splitlines()[-1] == "3,0,,"
    back = read_clients(tmp_path / "clients.csv")
    assert back[3] == {"client": 3.0, "samples": 0.0} and back[0]["accuracy"] == ACC[0]


def test_from_scores_without_samples_leaves_them_unknown() -> None:
    result = ClientEvaluation.from_scores(_scores(False), 2)
    assert result.samples_per_client is None
    assert [r["samples"] for r in result.rows()] == [-1, -1, -1, -1]


def test_spread_without_samples_counts_every_client() -> None:
    """Unknown samples: every client counts (the last client, with 0.75, too)."""
    result = ClientEvaluation.from_scores(_scores(False), 2)
    a, loss = np.array(ACC), np.array(LOSS)
    s = result.spread()
    assert_close_finite(s["acc_std"], a.std())
    assert_close_finite(s["acc_min"], a.min())
    assert_close_finite(s["acc_worst10"], a.min())  # ⌈0.1 · 4⌉ = 1 client
    r = result.spread(regression=True)
    assert_close_finite(r["mse_std"], loss.std())
    assert_close_finite(r["mse_max"], loss.max())
    assert_close_finite(r["mse_worst10"], loss.max())


# ---- validation_metrics ----------------------------------------------------------------------------------------
class _WithRepresentation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.representation = nn.Parameter(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))


def test_validation_metrics_of_a_regression_run_are_the_mse_spread() -> None:
    """Regression (``num_classes`` None): mse_mean and the spread of the per-client errors over clients with
    data (the 4th has none), the highest error being the worst."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    fed = SimpleNamespace(num_classes=None, extras={})
    m = validation_metrics(result, fed, nn.Linear(1, 1), prefix="val")
    loss = np.array(LOSS[:3])
    assert sorted(m) == ["val/mse_max", "val/mse_mean", "val/mse_std", "val/mse_worst10"]
    assert_close_finite(m["val/mse_mean"], 1.5)
    assert_close_finite(m["val/mse_std"], loss.std())
    assert_close_finite(m["val/mse_max"], 4.0)


def test_validation_metrics_of_a_classification_run_are_the_accuracy_spread() -> None:
    """Classification: acc_mean, acc_weighted, loss and the accuracy spread (the lowest being the worst)."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    fed = SimpleNamespace(num_classes=3, extras={})
    m = validation_metrics(result, fed, nn.Linear(1, 1), prefix="test")
    a = np.array(ACC[:3])
    assert sorted(m) == [
        "test/acc_mean",
        "test/acc_min",
        "test/acc_std",
        "test/acc_weighted",
        "test/acc_worst10",
        "test/loss",
    ]
    assert_close_finite(m["test/acc_std"], a.std())
    assert_close_finite(m["test/acc_min"], 0.25)


def test_validation_metrics_dist_b_needs_both_the_ground_truth_and_a_representation() -> None:
    """A representation without ``B_star``, or ``B_star`` with a network that has no representation: no
    ``dist_B`` (and no error); both: the sine of the largest principal angle (here B* ⟂ the representation's
    second column partly)."""
    result = ClientEvaluation.from_scores(_scores(True), 1)
    b_star = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    without_truth = validation_metrics(result, SimpleNamespace(num_classes=3, extras={}), _WithRepresentation())
    assert "val/dist_B" not in without_truth
    no_rep = validation_metrics(result, SimpleNamespace(num_classes=3, extras={"B_star": b_star}), nn.Linear(1, 1))
    assert "val/dist_B" not in no_rep
    both = validation_metrics(result, SimpleNamespace(num_classes=3, extras={"B_star": b_star}), _WithRepresentation())
    assert_close_finite(both["val/dist_B"], 1.0)  # span{e1, e2} vs span{e1, e3}: a right angle


# ---- score_outputs ---------------------------------------------------------------------------------------------
def test_score_outputs_regression_is_the_summed_squared_error_and_no_correct_count() -> None:
    out = torch.tensor([[1.0], [2.0], [4.0]])
    y = torch.tensor([[0.5], [2.5], [1.0]], dtype=torch.float64)
    correct, n, sq = score_outputs(out, y, None)
    assert correct == 0.0
    assert n == 3
    assert_close_finite(sq, 0.25 + 0.25 + 9.0)


def test_score_outputs_classification_counts_the_arg_max_hits() -> None:
    out = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [0.5, 2.0, 1.0]])
    y = torch.tensor([0, 2, 0])
    correct, n, loss = score_outputs(out, y, 3)
    assert int(correct) == 2 and n == 3
    lse = np.log(np.exp(out.numpy().astype(np.float64)).sum(1))
    assert_close_finite(loss, (lse - np.array([2.0, 3.0, 0.5])).sum(), rtol=1e-6)


# ---- shared_body_applies ---------------------------------------------------------------------------------------
class _BodyHeadOnly(nn.Module):
    """A network with ``body`` and ``head`` and no ``side`` attribute at all."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(3, 2), nn.Linear(2, 2)


def _module_2(net: nn.Module) -> SimpleNamespace:
    return SimpleNamespace(executor="vectorized", net=net, algorithm=FedAvg(1, personal=("head.",)))


def test_shared_body_applies_with_head_fine_tuning_and_not_with_body_fine_tuning() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    assert shared_body_applies(module, None)
    assert shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("body.",)))
    assert not shared_body_applies(module, FineTune(epochs=1, prefixes=("head.", "body.")))


def test_shared_body_applies_not_with_a_side_branch() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2), side=nn.Identity()))
    assert not shared_body_applies(module, None)


def test_shared_body_applies_to_a_network_without_a_side_attribute() -> None:
    assert shared_body_applies(_module_2(_BodyHeadOnly()), None)


def test_global_model_methods_with_server_or_client_state_evaluate_with_the_shared_body() -> None:
    """SCAFFOLD, FedDyn and MOON evaluate every client with the global model (their client state is kept under
    their own prefixes): the shared-body path applies to them, "+FT" of the head included."""
    from fl_lightning.algorithms import MOON, SCAFFOLD, FedDyn

    for algorithm in (SCAFFOLD(1), FedDyn(1), MOON(1)):
        module = SimpleNamespace(executor="vectorized", net=SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)),
                                 algorithm=algorithm)  # fmt: skip
        assert shared_body_applies(module, None), type(algorithm).__name__
        assert shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",))), type(algorithm).__name__
        glob, state = {"head.weight": torch.ones(2, 2)}, {"x.head.weight": torch.zeros(2, 2)}
        used = algorithm.client_model(glob, state)
        assert list(used) == ["head.weight"] and used["head.weight"] is glob["head.weight"]


def test_shared_body_applies_only_to_the_vectorized_executor() -> None:
    module = _module_2(SplitModel(nn.Linear(3, 2), nn.Linear(2, 2)))
    module.executor = "sequential"
    assert not shared_body_applies(module, None)


@pytest.fixture
def _stand_in_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_finetune_heads`` builds its contexts with ``executor.vector_context(module, ...)``: the stand-in's."""
    monkeypatch.setattr(evaluation, "vector_context", lambda module, *args, **kw: module.vector_context(*args, **kw))


# ---- model.eval_clients (issue 28) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["fedrep", "ditto"])
def test_sampled_evaluations_score_the_same_clients_and_the_final_one_scores_all(method: str) -> None:
    """``eval_clients: 12`` of 60: every periodic evaluation scores the same 12 clients, logs their mean accuracy
    and its standard error (numpy, with the finite-population correction); the evaluation after the last round
    scores all 60 (standard error 0)."""

    from benchmarks.scale import ScaleData
    from fl_lightning.algorithms import Ditto

    seen: list[tuple[list[int], np.ndarray, dict[str, float]]] = []

    class Spy(L.Callback):
        def on_validation_end(self, trainer, module) -> None:
            result = module.last_evaluation
            scored = (result.samples_per_client > 0).nonzero().flatten().tolist()
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/acc_mean")}
            seen.append((scored, result.acc_per_client[scored].double().numpy(), metrics))

    L.seed_everything(0, verbose=False)
    algo = FedRep(head_epochs=1, body_epochs=1) if method == "fedrep" else Ditto(lam=0.5)
    module = FederatedModule(algo, DigitsMLP(hidden=(8,)), lr=0.05, eval_clients=12, eval_last=0)
    fit(module, ScaleData(num_clients=60, clients_per_round=6), 4, callbacks=[Spy()])
    assert len(seen) == 4
    sample = seen[0][0]
    assert len(sample) == 12 and all(s[0] == sample for s in seen[:3])
    assert seen[3][0] == list(range(60))
    for _, acc, metrics in seen:
        n = len(acc)
        sem = acc.std(ddof=1) / np.sqrt(n) * np.sqrt((60 - n) / 59)
        assert metrics["val/acc_mean"] == pytest.approx(acc.mean(), abs=1e-6)
        assert metrics["val/acc_mean_sem"] == pytest.approx(sem, abs=1e-9)
    assert seen[3][2]["val/acc_mean_sem"] == 0.0 and module.summary["final"] == pytest.approx(seen[3][1].mean())


def test_evaluate_all_scores_every_client_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the validation loop every client is scored, ``CLIENTS_PER_STEP`` at a time (bounded memory)."""
    monkeypatch.setattr(evaluation, "CLIENTS_PER_STEP", 7)
    calls: list[list[int]] = []
    real = evaluation.evaluate_clients

    def spy(module: FederatedModule, clients: list[int], *args, **kwargs) -> None:
        calls.append(list(clients))
        real(module, clients, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_clients", spy)
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0, partition=Shards(classes_per_client=2))
    dm.setup("fit")
    module.attach_data(dm.federated)
    scores = module.evaluate_clients(0)
    assert [len(c) for c in calls] == [7, 7, 6] and sorted(sum(calls, [])) == list(range(20))
    assert int((scores["samples_per_client"] > 0).sum()) == 20


# ---- stacked scoring: every client's own model in one forward (issue 32) ---------------------------------------------
STACKED_TEST_SIZES = [3, 0, 7, 2, 12, 5]  # an empty client, and one above the group cap of the test (16 // 2 rows)


def _stacked_module(layer_norm: bool, executor: str = "vectorized") -> FederatedModule:
    gen = torch.Generator().manual_seed(5)
    sizes = STACKED_TEST_SIZES
    fed = FederatedData(_split([4] * len(sizes), gen), _split(sizes, gen), 3, seed=SEED)
    torch.manual_seed(1)
    body = [nn.Linear(4, 5), *([nn.LayerNorm(5)] if layer_norm else []), nn.Tanh()]
    net = SplitModel(nn.Sequential(*body), nn.Linear(5, 3)).double()
    module = FederatedModule(FedAvg(1, personal=("body.", "head.")), net, executor=executor)
    module.attach_data(fed)
    return module


def _own_models(module: FederatedModule) -> list[Params_2]:
    """Every client's whole model: the global one shifted by a client-specific amount."""
    gen = torch.Generator().manual_seed(9)
    glob = module.global_params()
    return [{n: v + 0.3 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for n, v in glob.items()}
            for _ in STACKED_TEST_SIZES]  # fmt: skip


def _hand_forward(p: Params_2, x: Tensor, layer_norm: bool) -> Tensor:
    h = x @ p["body.0.weight"].T + p["body.0.bias"]
    if layer_norm:
        h = F.layer_norm(h, (5,), p["body.1.weight"], p["body.1.bias"])
    return torch.tanh(h) @ p["head.weight"].T + p["head.bias"]


@pytest.mark.parametrize("layer_norm", [False, True], ids=["linear_stacked_forward", "layernorm_vmap"])
def test_stacked_scoring_equals_each_client_scored_alone_by_hand(monkeypatch: pytest.MonkeyPatch, layer_norm: bool):
    """Uneven test splits (3, 0, 7, 2, 12, 5 rows) padded into groups of at most 16 rows: the 12-row client is scored
    alone (``score_client``), the empty one not at all; every client's (correct, samples, summed loss) equals its own
    model's forward by hand, for a Linear network (``stacked_forward``) and one with a LayerNorm (``vmap``)."""
    monkeypatch.setattr(evaluation, "STACKED_ROWS", 16)
    groups: list[list[int]] = []
    real_group = evaluation._score_padded
    monkeypatch.setattr(evaluation, "_score_padded", lambda *a: (groups.append(list(a[3])), real_group(*a))[1])
    module = _stacked_module(layer_norm)
    models = _own_models(module)
    scores = PerClientScores(len(STACKED_TEST_SIZES))
    clients = list(range(len(STACKED_TEST_SIZES)))
    assert evaluation.stacked_scoring_applies(module, None, len(clients))
    evaluation.evaluate_clients(module, clients, ROUND, scores, state_of=lambda c: models[c])
    assert groups == [[0, 2], [3, 5]]  # 2 × 7 ≤ 16, then 3 × 7 > 16; client 4 alone, client 1 empty
    for c in clients:
        x, y = module.fed.test.client(c)
        out = _hand_forward(models[c], x, layer_norm)
        assert scores.total[c] == x.shape[0]
        assert scores.correct[c] == float((out.argmax(1) == y).sum())
        expected = float(F.cross_entropy(out.float(), y, reduction="sum")) if x.shape[0] else 0.0
        assert float(scores.loss_sum[c]) == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["linear_stacked_forward", "layernorm_vmap"])
def test_stacked_scoring_adapts_each_client_on_its_training_rows_first(monkeypatch, layer_norm: bool) -> None:
    """Per-FedAvg adapts at evaluation (w − α∇f_i(w) on client i's training rows): on the stacked path every client
    of a group adapts at once, then scores; each client's numbers equal its adapted model by hand (the 12-row client
    in a group of its own, the empty test split not scored)."""
    monkeypatch.setattr(evaluation, "STACKED_ROWS", 16)
    module = _stacked_module(layer_norm)
    module.algorithm = PerFedAvg(adapt_lr=0.5, adapt_steps=2)
    clients = list(range(len(STACKED_TEST_SIZES)))
    assert evaluation.stacked_scoring_applies(module, None, len(clients))
    scores = PerClientScores(len(clients))
    evaluation.evaluate_clients(module, clients, ROUND, scores, state_of=lambda c: {})
    glob = module.global_params()
    for c in clients:
        w = {n: v.detach().clone() for n, v in glob.items()}
        xt, yt = module.fed.train.client(c)
        for _ in range(2):
            leaves = {n: v.requires_grad_(True) for n, v in w.items()}
            g = torch.autograd.grad(F.cross_entropy(_hand_forward(leaves, xt, layer_norm), yt), list(leaves.values()))
            w = {n: (v - 0.5 * d).detach() for (n, v), d in zip(leaves.items(), g)}
        x, y = module.fed.test.client(c)
        out = _hand_forward(w, x, layer_norm)
        assert scores.total[c] == x.shape[0]
        assert scores.correct[c] == float((out.argmax(1) == y).sum())
        expected = float(F.cross_entropy(out.float(), y, reduction="sum")) if x.shape[0] else 0.0
        assert float(scores.loss_sum[c]) == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_stacked_scoring_applies_only_where_nothing_runs_per_client_before_the_forward() -> None:
    module = _stacked_module(False)
    assert evaluation.stacked_scoring_applies(module, None, 6)
    auto = _stacked_module(False, executor="auto")
    assert evaluation.stacked_scoring_applies(auto, None, 6)
    assert not evaluation.stacked_scoring_applies(auto, None, 1)  # auto: the loop is faster for one client on the CPU
    assert not evaluation.stacked_scoring_applies(module, FineTune(epochs=1), 6)
    assert not evaluation.stacked_scoring_applies(_stacked_module(False, executor="sequential"), None, 6)
    for algorithm in (_ScaledPredict(1, personal=("head.",)), _RecordingAdapt()):
        module.algorithm = algorithm
        assert not evaluation.stacked_scoring_applies(module, None, 6)
    module.algorithm = FedAvg(1)
    module.fed.num_classes = None  # regression: scored client by client
    assert not evaluation.stacked_scoring_applies(module, None, 6)


def test_row_groups_pad_at_most_cap_rows_and_leave_out_empty_clients() -> None:
    sizes = [3, 0, 7, 2, 12, 5, 8, 1]
    groups = evaluation.row_groups(sizes, 16)
    assert groups == [[0, 2], [4], [3, 5], [6, 7]]  # [4]: 12 > 16 // 2 alone; [3, 5, 6] would pad 3 × 8 > 16
    assert sorted(sum(groups, [])) == [k for k, n in enumerate(sizes) if n]
    assert all(len(g) * max(sizes[k] for k in g) <= 16 for g in groups)


@pytest.mark.parametrize("finetune", [None, FineTune.head_only(1)], ids=["scores", "ft"])
def test_shared_body_heads_scored_in_groups_equal_each_clients_head_by_hand(
    monkeypatch: pytest.MonkeyPatch, finetune: FineTune | None
) -> None:
    """The shared-body path (FedRep-like: personal heads) with its heads applied a group at a time: every client's
    numbers equal its own head on the global body's features by hand (the 12-row client alone; "+FT" tunes the
    heads first, so only the plain case is compared by hand: with "+FT" the groups are checked against the loop)."""
    monkeypatch.setattr(evaluation, "STACKED_ROWS", 16)
    module = _stacked_module(False)
    module.algorithm = FedAvg(1, personal=("head.",))
    models = _own_models(module)
    glob = module.global_params()
    heads = [{n: v for n, v in m.items() if n.startswith("head.")} for m in models]
    assert shared_body_applies(module, finetune, 6)
    scores = PerClientScores(6)
    evaluation.evaluate_clients(module, list(range(6)), ROUND, scores, finetune=finetune, state_of=lambda c: heads[c])
    if finetune is None:
        for c in range(6):
            x, y = module.fed.test.client(c)
            out = _hand_forward({**glob, **heads[c]}, x, False)
            assert scores.total[c] == x.shape[0] and scores.correct[c] == float((out.argmax(1) == y).sum())
            expected = float(F.cross_entropy(out.float(), y, reduction="sum")) if x.shape[0] else 0.0
            assert float(scores.loss_sum[c]) == pytest.approx(expected, rel=1e-6, abs=1e-9)
        return
    loop = _stacked_module(False, executor="sequential")
    loop.algorithm = FedAvg(1, personal=("head.",))
    expected = PerClientScores(6)
    evaluation.evaluate_clients(loop, list(range(6)), ROUND, expected, finetune=finetune, state_of=lambda c: heads[c])
    assert scores.total.tolist() == expected.total.tolist() and scores.correct.tolist() == expected.correct.tolist()
    assert_close_finite(scores.loss_sum, expected.loss_sum, rtol=1e-5, atol=1e-7)


def test_shared_body_regression_scores_each_clients_head_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression on the shared-body path: every client's summed squared error of its own head on the global body's
    features, by hand (clients are scored one at a time there; the empty client adds nothing)."""
    monkeypatch.setattr(evaluation, "STACKED_ROWS", 16)
    gen = torch.Generator().manual_seed(5)
    sizes = STACKED_TEST_SIZES

    def split(rows: list[int]) -> ClientSplit:
        n = sum(rows)
        ptr = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
        return ClientSplit(torch.randn(n, 4, generator=gen, dtype=torch.float64),
                           torch.randn(n, 3, generator=gen, dtype=torch.float64), ptr)  # fmt: skip

    torch.manual_seed(1)
    net = SplitModel(nn.Sequential(nn.Linear(4, 5), nn.Tanh()), nn.Linear(5, 3)).double()
    module = FederatedModule(FedAvg(1, personal=("head.",)), net, executor="vectorized")
    module.attach_data(FederatedData(split([4] * len(sizes)), split(sizes), None, seed=SEED))
    glob = module.global_params()
    heads = [{n: v for n, v in m.items() if n.startswith("head.")} for m in _own_models(module)]
    assert shared_body_applies(module, None, len(sizes))
    scores = PerClientScores(len(sizes))
    evaluation.evaluate_clients(module, list(range(len(sizes))), ROUND, scores, state_of=lambda c: heads[c])
    for c in range(len(sizes)):
        x, y = module.fed.test.client(c)
        err = float(((_hand_forward({**glob, **heads[c]}, x, False) - y) ** 2).sum())
        assert scores.total[c] == x.shape[0] and scores.correct[c] == 0
        assert math.isfinite(err) and float(scores.loss_sum[c]) == pytest.approx(err, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["stacked_body", "layernorm_body"])
def test_shared_body_scores_a_single_test_row_with_any_body(layer_norm: bool) -> None:
    """The shared-body path with one test row among all its clients (client 1's; client 0 has none) scores that
    row: its head on the global body's features by hand, for a body ``stacked_forward`` computes (Linear, Tanh)
    and one it does not (a LayerNorm: the body runs as a plain module); an empty list of clients adds nothing."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(2)
    body = [nn.Linear(4, 5), *([nn.LayerNorm(5)] if layer_norm else []), nn.Tanh()]
    net = SplitModel(nn.Sequential(*body), nn.Linear(5, 3)).double()
    module = FederatedModule(FedAvg(1, personal=("head.",)), net, executor="vectorized")
    module.attach_data(FederatedData(_split([4, 4], gen), _split([0, 1], gen), 3, seed=SEED))
    assert shared_body_applies(module, None, 2)
    glob = module.global_params()
    heads = [{"head.weight": glob["head.weight"] + 0.3 * c, "head.bias": glob["head.bias"] - 0.2 * c} for c in (0, 1)]
    scores = PerClientScores(2)
    evaluation.evaluate_clients(module, [0, 1], ROUND, scores, state_of=lambda c: heads[c])
    x, y = module.fed.test.client(1)
    h = x @ glob["body.0.weight"].T + glob["body.0.bias"]
    if layer_norm:
        h = F.layer_norm(h, (5,), glob["body.1.weight"], glob["body.1.bias"])
    out = torch.tanh(h) @ heads[1]["head.weight"].T + heads[1]["head.bias"]
    assert scores.total.tolist() == [0, 1] and scores.correct[1] == float((out.argmax(1) == y).sum())
    expected = float(F.cross_entropy(out.float(), y, reduction="sum"))
    assert float(scores.loss_sum[1]) == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert float(scores.loss_sum[0]) == 0.0
    evaluation.evaluate_clients(module, [], ROUND, scores, state_of=lambda c: heads[c])  # no client: nothing added
    assert scores.total.tolist() == [0, 1] and float(scores.loss_sum[1]) == pytest.approx(expected, rel=1e-6)
