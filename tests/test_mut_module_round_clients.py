"""``FederatedModule.run_clients`` and ``training_step`` with a recording method whose update is known in closed
form (no SGD), so every number is checked against values written out here.

``run_clients``: a run batched with others hands everything to its ``run_axis``; otherwise each client gets a
context with its step budget and the round, the algorithm's state without the kept optimiser state, and the kept
optimiser state (only with ``keep_client_optimizer_state``), which comes back merged into the new state; the
vectorized path stacks and unstacks the same things. ``training_step``: who fails and who straggles follows the
seeded coins of each (round, client) (reference: the blake2b seed derivation written out), stragglers get the
straggler budget, the fault counts are logged, the ledger records each round under its index, and every rank's
reporting positions go to the cross-rank reduction.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from conftest import make_trainer
from helpers import assert_close_finite
from torch import Tensor

from datamodules import SyntheticLinearDataModule
from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.engine import aggregation
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.executor import decide
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP, LinearRepresentation

SIZES = (3, 4, 5, 2)
KEPT = "client_optimizer."


class _Recorder(Algorithm):
    """Personal head; a client uploads ``global + client/100``, its new state is twice the old one, its kept
    optimiser state comes back one higher; loss = client id, one metric = 10·client. Every context is recorded."""

    personal = ("head.",)
    vectorizable = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def client_update(self, ctx: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        kept = ctx.optimizer_state
        vector = hasattr(ctx, "clients")
        self.calls.append(
            {
                "vector": vector,
                "clients": list(ctx.clients) if vector else [ctx.client],
                "round": ctx.round,
                "budgets": list(ctx.step_budgets) if vector else [ctx.step_budget],
                "kept": None if kept is None else {n: v.clone() for n, v in kept.items()},
                "state": {n: v.clone() for n, v in state.items()},
                "global": {n: v.clone() for n, v in global_params.items()},
            }
        )
        if kept is not None:
            ctx.optimizer_state = {n: v + 1 for n, v in kept.items()}
        c = torch.tensor(ctx.clients if vector else ctx.client, dtype=torch.float32)
        shift = c.view(-1, *[1] * (next(iter(global_params.values())).dim() - 1)) if vector else c
        upload = {n: global_params[n] + shift / 100 for n in self.shared_names(global_params)}
        new_state = {n: 2 * v for n, v in state.items()}
        return ClientUpdate(upload, new_state, ctx.num_samples, c.double(), {"m": 10 * c})


def _fed() -> FederatedData:
    g = torch.Generator().manual_seed(3)
    n = sum(SIZES)
    ptr = torch.tensor([0, 3, 7, 12, 14], dtype=torch.long)
    split = ClientSplit(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), ptr)
    return FederatedData(split, split, 10, 5)


def _module(keep: bool, executor: str) -> FederatedModule:
    module = FederatedModule(
        _Recorder(), DigitsMLP(hidden=(3,)), momentum=0.5, keep_client_optimizer_state=keep, executor=executor
    )
    module.attach_data(_fed())
    g = torch.Generator().manual_seed(9)
    for name in module.bank.names:  # distinct rows per client, so a mixed-up row shows
        row = module.bank.row(name)
        if row.is_floating_point():
            row.copy_(torch.randn(row.shape, generator=g))
        else:
            row.copy_(torch.arange(row.shape[0]) + 3)
    return module


def _glob(module: FederatedModule) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.net.named_parameters()}


def _bank_row(module: FederatedModule, c: int) -> dict[str, Tensor]:
    return {n: module.bank.row(n)[c].clone() for n in module.bank.names}


# ---- run_clients ---------------------------------------------------------------------------------------------
class _Axis:
    def __init__(self) -> None:
        self.args: tuple | None = None
        self.result = [object()]

    def run_clients(self, *args: Any) -> list:
        self.args = args
        return self.result


def test_a_batched_run_hands_the_round_to_its_run_axis() -> None:
    module = _module(False, "sequential")
    axis = _Axis()
    module.run_axis = axis
    glob, states, budgets = _glob(module), [_bank_row(module, 1), _bank_row(module, 3)], [1.0, 0.5]
    clients = [1, 3]
    assert module.run_clients(clients, 4, glob, states, budgets) is axis.result
    assert axis.args is not None and len(axis.args) == 6
    assert axis.args[0] is module and axis.args[1] is clients and axis.args[2] == 4
    assert axis.args[3] is glob and axis.args[4] is states and axis.args[5] is budgets
    assert module.algorithm.calls == []


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_kept_optimizer_state_goes_in_through_the_context_and_comes_back_in_the_state(executor: str) -> None:
    """With ``keep_client_optimizer_state``: the algorithm sees its own state only, the context the kept rows;
    each client's new state is the algorithm's (2·old) plus the kept rows the context ends with (old + 1)."""
    module = _module(True, executor)
    assert decide(module, len([2, 0, 3])).stacked is (executor == "vectorized")
    clients, budgets = [2, 0, 3], [1.0, 0.25, 0.5]
    glob = _glob(module)
    before = [_bank_row(module, c) for c in clients]
    assert any(n.startswith(KEPT) for n in before[0]) and "head.weight" in before[0]
    updates = module.run_clients(clients, 6, glob, before, budgets)

    calls = module.algorithm.calls
    assert len(calls) == (1 if executor == "vectorized" else 3)
    assert [c for call in calls for c in call["clients"]] == clients
    assert [b for call in calls for b in call["budgets"]] == budgets
    assert all(call["round"] == 6 for call in calls)
    for k, c in enumerate(clients):
        call, i = (calls[0], k) if executor == "vectorized" else (calls[k], None)

        def row(t: Tensor, i: int | None = i) -> Tensor:
            return t if i is None else t[i]

        assert set(call["state"]) == {"head.weight", "head.bias"}
        assert set(call["kept"]) == {n for n in before[k] if n.startswith(KEPT)}
        for n, v in call["state"].items():
            assert_close_finite(row(v), before[k][n])
        for n, v in call["kept"].items():
            assert torch.equal(row(v), before[k][n]), n
        for n, v in call["global"].items():
            assert_close_finite(row(v), glob[n])

        upd = updates[k]
        assert set(upd.state) == set(before[k])
        for n, v in upd.state.items():
            expected = before[k][n] + 1 if n.startswith(KEPT) else 2 * before[k][n]
            assert v.shape == before[k][n].shape, n
            assert torch.equal(v, expected) if not v.is_floating_point() else bool(torch.allclose(v, expected)), n
        assert set(upd.upload) == {n for n in glob if not n.startswith("head.")}
        for n, v in upd.upload.items():
            assert_close_finite(v, glob[n] + c / 100, rtol=1e-6, atol=1e-6)
        assert upd.num_samples == SIZES[c]
        assert_close_finite(upd.loss, float(c))
        assert set(upd.metrics) == {"m"}
        assert_close_finite(upd.metrics["m"], 10.0 * c)


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_without_kept_state_the_context_starts_a_fresh_optimizer(executor: str) -> None:
    """Without ``keep_client_optimizer_state`` every context has no optimiser state (``None``: fresh) and the new
    state is the algorithm's only."""
    module = _module(False, executor)
    clients = [1, 3]
    before = [_bank_row(module, c) for c in clients]
    assert set(before[0]) == {"head.weight", "head.bias"}
    updates = module.run_clients(clients, 2, _glob(module), before, [1.0, 1.0])
    assert module.algorithm.calls and all(call["kept"] is None for call in module.algorithm.calls)
    for k in range(2):
        assert set(updates[k].state) == {"head.weight", "head.bias"}
        for n, v in updates[k].state.items():
            assert_close_finite(v, 2 * before[k][n])


def test_vectorized_single_client() -> None:
    module = _module(False, "vectorized")
    before = [_bank_row(module, 2)]
    (upd,) = module.run_clients([2], 0, _glob(module), before, [1.0])
    assert module.algorithm.calls[0]["vector"] is True
    assert upd.num_samples == SIZES[2]
    for n, v in upd.state.items():
        assert_close_finite(v, 2 * before[0][n])


def test_no_clients_run_nothing() -> None:
    module = _module(False, "sequential")
    assert module.run_clients([], 0, _glob(module), [], []) == []
    assert module.algorithm.calls == []


# ---- training_step -------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def test_the_cohorts_bank_rows_are_gathered_with_ids_on_the_modules_device() -> None:
    """The round's client ids index the bank on the module's device (``meta`` stands in for an accelerator)."""
    module = _module(False, "sequential")
    module._device = torch.device("meta")
    seen: list[Tensor] = []

    def gather(clients: Tensor) -> dict[str, Tensor]:
        seen.append(clients)
        raise _Stop

    module.bank.gather = gather
    with pytest.raises(_Stop):
        module.training_step({"round": torch.tensor(0), "clients": torch.tensor([2, 0])}, 0)
    assert len(seen) == 1 and seen[0].device.type == "meta"


def _coin(seed: int, tag: str, round_idx: int, client: int) -> float:
    """The seeded coin of (seed, tag, round, client): blake2b of the parts' repr, 63 bits, one ``torch.rand``."""
    digest = hashlib.blake2b(repr((seed, tag, round_idx, client)).encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    return float(torch.rand(1, generator=g))


class _RoundRecorder(Algorithm):
    """Shared-only method: a client uploads the global model plus a small client-dependent shift."""

    vectorizable = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, float]] = []

    def client_update(self, ctx: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        self.calls.append((ctx.round, ctx.client, ctx.step_budget))
        upload = {n: v + 0.001 * (ctx.client + 1) for n, v in global_params.items()}
        return ClientUpdate(upload, dict(state), ctx.num_samples, 0.5)


DROPOUT, STRAGGLERS, BUDGET, CLIENTS, ROUNDS = 0.3, 0.5, 0.25, 8, 2


@pytest.fixture(scope="module")
def faulty_fit() -> dict[str, Any]:
    """Two rounds, all 8 clients every round, with dropout and stragglers; the logs and the reduction's layouts."""
    torch.manual_seed(0)
    dm = SyntheticLinearDataModule(num_clients=CLIENTS, dim=4, rank=2, samples_per_client=3, participation=1.0, seed=2)
    module = FederatedModule(
        _RoundRecorder(),
        LinearRepresentation(4, 2),
        aggregation="uniform",
        client_dropout=DROPOUT,
        stragglers=STRAGGLERS,
        straggler_budget=BUDGET,
        eval_every=100,
        executor="sequential",  # the recorder reads ctx.client: the reference loop's context
    )
    logged: list[dict[str, Any]] = []
    original_log_dict = module.log_dict
    module.log_dict = lambda metrics, **kw: (logged.append(dict(metrics)), original_log_dict(metrics, **kw))
    layouts: list[Any] = []
    original_all_reduce = aggregation.CohortSums.all_reduce

    def all_reduce(self: Any, strategy: Any, device: torch.device, layout: Any = None) -> Any:
        layouts.append(layout)
        return original_all_reduce(self, strategy, device, layout)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aggregation.CohortSums, "all_reduce", all_reduce)
        make_trainer(ROUNDS, logger=False).fit(module, datamodule=dm)
    seed = module.fed.seed
    failed = {(r, c) for r in range(ROUNDS) for c in range(CLIENTS) if _coin(seed, "dropout", r, c) < DROPOUT}
    slow = {(r, c) for r in range(ROUNDS) for c in range(CLIENTS) if _coin(seed, "straggler", r, c) < STRAGGLERS}
    return {"module": module, "logged": logged, "layouts": layouts, "failed": failed, "slow": slow}


def test_faults_follow_each_rounds_coins_and_stragglers_get_the_budget(faulty_fit: dict[str, Any]) -> None:
    failed, slow = faulty_fit["failed"], faulty_fit["slow"]
    assert failed and slow - failed and set(range(CLIENTS)) - {c for r, c in failed | slow if r == 0}
    expected = [
        (r, c, BUDGET if (r, c) in slow else 1.0) for r in range(ROUNDS) for c in range(CLIENTS) if (r, c) not in failed
    ]
    assert sorted(faulty_fit["module"].algorithm.calls) == expected


def test_fault_counts_are_logged_each_round(faulty_fit: dict[str, Any]) -> None:
    failed, slow = faulty_fit["failed"], faulty_fit["slow"]
    faults = [m for m in faulty_fit["logged"] if "faults/stragglers" in m]
    assert len(faults) == ROUNDS
    for r, m in enumerate(faults):
        assert float(m["faults/dropped"]) == sum(1 for c in range(CLIENTS) if (r, c) in failed)
        assert float(m["faults/stragglers"]) == sum(1 for c in range(CLIENTS) if (r, c) in slow - failed)


def test_the_ledger_records_each_round_under_its_index(faulty_fit: dict[str, Any]) -> None:
    assert [h.round for h in faulty_fit["module"].ledger.history] == list(range(ROUNDS))


def test_the_reduction_gets_every_ranks_reporting_positions(faulty_fit: dict[str, Any]) -> None:
    """One process: one rank holding the whole cohort; its reporting positions are the clients that did not fail
    (the cohort is every client in order, so position = client id)."""
    failed = faulty_fit["failed"]
    expected = [[[c for c in range(CLIENTS) if (r, c) not in failed]] for r in range(ROUNDS)]
    assert faulty_fit["layouts"] == expected


class _BadUpload(_RoundRecorder):
    def client_update(self, ctx: Any, global_params: dict[str, Tensor], state: dict[str, Tensor]) -> ClientUpdate:
        return ClientUpdate({}, dict(state), ctx.num_samples, 0.5)


def test_an_upload_that_is_not_the_template_names_the_method() -> None:
    dm = SyntheticLinearDataModule(num_clients=3, dim=4, rank=2, samples_per_client=3, participation=1.0, seed=2)
    module = FederatedModule(_BadUpload(), LinearRepresentation(4, 2), aggregation="uniform", eval_every=100)
    with pytest.raises(RuntimeError, match=r"^_BadUpload uploaded \[\], not its template"):
        make_trainer(1, logger=False).fit(module, datamodule=dm)
