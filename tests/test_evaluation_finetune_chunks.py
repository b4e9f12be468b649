"""``evaluation._finetune_heads``: the "+FT" fast path fine-tunes the clients' heads in chunks of 256 clients.

The module is a stand-in whose ``vector_context`` returns a context with a transparent ``sgd``: it checks that
every parameter is stacked one row per client of the chunk and returns, for the trained names, ``2·v + client``
row by row. So each client's tuned head is known by hand (``2·head + client id``), and a client that got another
client's head, a chunk that skipped or repeated a client, or a result list of the wrong length shows.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.client import Params, select
from fl_lightning.engine import evaluation
from fl_lightning.engine.evaluation import FineTune, _finetune_heads


@pytest.fixture(autouse=True)
def _stand_in_contexts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_finetune_heads`` builds its contexts with ``executor.vector_context(module, ...)``: the stand-in's."""
    monkeypatch.setattr(evaluation, "vector_context", lambda module, *args, **kw: module.vector_context(*args, **kw))


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

    def vector_context(self, clients: list[int], round_idx: int, budgets: list[float], tag: str = "train") -> _Context:
        assert tag == "evaluation" and round_idx == 4 and len(budgets) == len(clients)
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
    out = _finetune_heads(module, clients, _glob(), heads, 4, FineTune(epochs=3, prefixes=("head.",)))
    assert len(out) == len(clients)
    for k, c in enumerate(clients):
        assert sorted(out[k]) == ["head.b", "head.w"]
        for n in ("head.w", "head.b"):
            assert_close_finite(out[k][n], 2 * heads[k][n] + c, msg=f"client {c} {n}")
    return module


def test_finetune_heads_chunks_300_clients_as_256_then_44_and_keeps_each_clients_head() -> None:
    """300 clients: two chunks (256 and 44, in order), the head names trained for the configured epochs, and
    every client's tuned head is its own head's."""
    clients = [3 * j + 1 for j in range(300)]
    module = _check(clients)
    assert [c["clients"] for c in module.calls] == [clients[:256], clients[256:]]
    assert all(c["trainable"] == ["head.w", "head.b"] and c["epochs"] == 3 for c in module.calls)


def test_finetune_heads_single_and_few_clients() -> None:
    """One client and three clients: a single chunk each, one result per client."""
    for clients in ([7], [5, 0, 9]):
        module = _check(clients)
        assert [c["clients"] for c in module.calls] == [clients]
