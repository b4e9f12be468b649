"""``evaluation.evaluate_clients`` against a plain-torch reference written here.

Three clients of a tiny float64 network ``head(tanh(body(x)))`` (4 → 5 → 3 classes), each with its own head. The
reference scores a client's test rows (correct arg-max predictions, summed cross-entropy) with the forward written
out by hand, and "+FT" as plain SGD (lr 0.5, no momentum, batches of 2) over the client's training rows in the
order of ``randperm`` drawn from a generator seeded with the low 63 bits of the BLAKE2b digest of
``repr((seed, "evaluation", round, client))`` (the client's evaluation stream; see
``tests/test_rounds_seed_derivation.py``). It checks the default split (test, not val), the algorithm's own
``predict`` and evaluation-time adaptation context, and "+FT" on both executors, body and head fine-tuning.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.algorithms import FedAvg
from fl_lightning.client import ClientContext
from fl_lightning.engine import evaluation
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.evaluation import FineTune
from fl_lightning.engine.module import FederatedModule
from fl_lightning.metrics import PerClientScores
from fl_lightning.models.split import SplitModel

Params = dict[str, Tensor]
SEED, ROUND, LR, BS = 11, 7, 0.5, 2
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
    module = FederatedModule(algorithm, net, lr=LR, momentum=0.0, batch_size=BS, executor=executor)
    module.attach_data(_fed())
    return module


def _heads(module: FederatedModule) -> list[Params]:
    """Every client's own head: the global head shifted by a client-specific amount."""
    glob = module.global_params()
    return [
        {
            "head.weight": glob["head.weight"] + 0.4 * (c - 1) * torch.ones_like(glob["head.weight"]).tril(),
            "head.bias": glob["head.bias"] + torch.tensor([0.3 * c, -0.2, 0.1 * c], dtype=torch.float64),
        }
        for c in range(3)
    ]


def _forward(p: Params, x: Tensor) -> Tensor:
    h = torch.tanh(x @ p["body.0.weight"].T + p["body.0.bias"])
    return h @ p["head.weight"].T + p["head.bias"]


def _evaluation_stream(client: int) -> torch.Generator:
    """The client's evaluation generator of round ``ROUND``, seeded by the reference derivation."""
    digest = hashlib.blake2b(repr((SEED, "evaluation", ROUND, client)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)


def _reference_finetune(p: Params, x: Tensor, y: Tensor, client: int, names: list[str]) -> Params:
    """One epoch of plain SGD (lr 0.5, mean cross-entropy of each batch of 2) on ``names``."""
    p = {n: v.clone() for n, v in p.items()}
    perm = torch.randperm(x.shape[0], generator=_evaluation_stream(client))
    for i in range(0, x.shape[0], BS):
        idx = perm[i : i + BS]
        leaves = {n: p[n].detach().requires_grad_(True) for n in names}
        loss = F.cross_entropy(_forward({**p, **leaves}, x[idx]), y[idx])
        grads = torch.autograd.grad(loss, list(leaves.values()))
        for n, g in zip(names, grads):
            p[n] = (p[n] - LR * g).detach()
    return p


def _reference_scores(
    module: FederatedModule, heads: list[Params], split: str, tune: list[str] | None = None,
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


def _evaluate(module: FederatedModule, heads: list[Params], **kwargs: object) -> PerClientScores:
    scores = PerClientScores(3)
    evaluation.evaluate_clients(module, [0, 1, 2], ROUND, scores, state_of=lambda c: heads[c], **kwargs)
    return scores


def _check(scores: PerClientScores, expected: tuple[list[float], list[float], list[float]]) -> None:
    correct, total, loss = expected
    assert scores.total.tolist() == total
    assert scores.correct.tolist() == correct
    # the loss is summed in float32 (``score_outputs``), hence the float32-level tolerance
    assert_close_finite(scores.loss_sum, torch.tensor(loss, dtype=torch.float64), rtol=1e-6, atol=1e-9)


def test_default_split_is_the_test_split() -> None:
    """Without ``split`` every client is scored on its test rows (3, 4, 2 of them; the val split has 2, 3, 2)."""
    module = _module(FedAvg(1, personal=("head.",)))
    heads = _heads(module)
    _check(_evaluate(module, heads), _reference_scores(module, heads, "test"))
    _check(_evaluate(module, heads, split="val"), _reference_scores(module, heads, "val"))


class _ScaledPredict(FedAvg):
    """An algorithm whose outputs are the network's logits negated and doubled (its own ``predict``)."""

    def predict(self, net: nn.Module, params: Params, x: Tensor, side: Tensor | None) -> Tensor:
        return -2.0 * super().predict(net, params, x, side)


def test_the_algorithms_predict_gives_the_scored_outputs() -> None:
    module = _module(_ScaledPredict(1, personal=("head.",)))
    heads = _heads(module)
    expected = _reference_scores(module, heads, "test", transform=lambda out: -2.0 * out)
    assert expected != _reference_scores(module, heads, "test")  # the case tells the two apart
    _check(_evaluate(module, heads, split="test"), expected)


class _RecordingAdapt(FedAvg):
    """Records the context each client adapts in: its client id, round and first draw of its generator."""

    def __init__(self) -> None:
        super().__init__(1, personal=("head.",))
        self.seen: list[tuple[int, int, float]] = []

    def adapt_for_evaluation(self, ctx: ClientContext, params: Params) -> Params:
        self.seen.append((ctx.client, ctx.round, float(torch.rand(1, generator=ctx.generator))))
        return params


def test_evaluation_adapts_in_the_clients_evaluation_stream_of_the_round() -> None:
    algorithm = _RecordingAdapt()
    module = _module(algorithm)
    heads = _heads(module)
    _check(_evaluate(module, heads, split="test"), _reference_scores(module, heads, "test"))
    expected = [(c, ROUND, float(torch.rand(1, generator=_evaluation_stream(c)))) for c in range(3)]
    assert algorithm.seen == expected


def test_finetune_of_the_head_client_by_client() -> None:
    """Sequential executor, "+FT" of the head: each client's head after one epoch of SGD in its evaluation
    stream's order."""
    module = _module(FedAvg(1, personal=("head.",)))
    heads = _heads(module)
    expected = _reference_scores(module, heads, "test", tune=["head.weight", "head.bias"])
    _check(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("head.",))), expected)


def test_finetune_of_the_head_on_the_shared_body_fast_path() -> None:
    """Vectorized executor (the shared-body fast path): the same fine-tuned heads as the reference."""
    module = _module(FedAvg(1, personal=("head.",)), executor="vectorized")
    assert evaluation.shared_body_applies(module, FineTune(epochs=1, prefixes=("head.",)))
    heads = _heads(module)
    expected = _reference_scores(module, heads, "test", tune=["head.weight", "head.bias"])
    assert expected[2] != _reference_scores(module, heads, "test")[2]  # fine-tuning changes the losses
    _check(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("head.",))), expected)


def test_finetune_of_the_body_on_the_vectorized_executor_tunes_the_body() -> None:
    """Vectorized executor but "+FT" of the body: the fast path (which keeps only the heads) does not apply and
    each client is scored with its fine-tuned body."""
    module = _module(FedAvg(1, personal=("head.",)), executor="vectorized")
    heads = _heads(module)
    expected = _reference_scores(module, heads, "test", tune=["body.0.weight", "body.0.bias"])
    assert expected[2] != _reference_scores(module, heads, "test")[2]
    _check(_evaluate(module, heads, finetune=FineTune(epochs=1, prefixes=("body.",))), expected)
