"""``fl_lightning/engine/contract.py``: an algorithm that declares ``vectorizable = True`` uses only what the stacked
path offers (``fl_lightning.client.Client``), checked from its source before a run starts; every algorithm of
``fl_lightning/algorithms/`` passes, and the one-line error names the first use of what the stacked path lacks."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fl_lightning.algorithms as algorithms_package
from datamodules import SyntheticLinearDataModule
from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.algorithms.fedavg import FedAvg
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.client import Client, LoopClient, Params
from fl_lightning.engine.contract import CLIENT, LOOP_ONLY, check_vectorizable, contract_problems
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.sequential import ClientContext
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.errors import ConfigError
from fl_lightning.models.linear import LinearRepresentation


def algorithm_classes() -> list[type[Algorithm]]:
    """Every ``Algorithm`` subclass defined in a module of ``fl_lightning/algorithms/``."""
    found = []
    for info in pkgutil.iter_modules(algorithms_package.__path__):
        module = importlib.import_module(f"{algorithms_package.__name__}.{info.name}")
        found += [
            c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, Algorithm) and c.__module__ == module.__name__
        ]
    return found


CLASSES = algorithm_classes()
VECTORIZABLE = [c for c in CLASSES if vars(c).get("vectorizable", False)]


def test_the_algorithms_are_all_found() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"FedAvg", "FedRep", "FedProx", "IFCA", "FedALA", "LinearFedRep", "PFedMe"} <= names
    assert len(VECTORIZABLE) >= 19  # the stacked path's list in engine/stacked.py's docstring


@pytest.mark.parametrize("cls", VECTORIZABLE, ids=lambda c: c.__name__)
def test_every_vectorizable_algorithm_uses_only_the_client_contract(cls: type[Algorithm]) -> None:
    assert contract_problems(cls) == []
    check_vectorizable(cls)  # no error


def test_the_split_of_the_contract_matches_the_two_implementations() -> None:
    """``Client`` is what both contexts have; what ``LoopClient`` adds only the sequential one has."""
    assert LOOP_ONLY == {"x", "y", "client", "side", "generator", "batches"}
    assert {"sgd", "forward", "num_samples", "train_loss", "param_names", "class_sums_seen"} <= CLIENT
    assert not CLIENT & LOOP_ONLY
    for name in CLIENT:
        assert hasattr(VectorizedContext, name) or name in VectorizedContext.__init__.__code__.co_names, name
    for name in LOOP_ONLY:
        assert hasattr(ClientContext, name) or name in ClientContext.__init__.__code__.co_names, name
        assert not hasattr(VectorizedContext, name), name
        assert name not in VectorizedContext.__init__.__code__.co_names, name  # nor set on an instance


def test_loop_only_algorithms_say_so_with_their_annotation() -> None:
    """A method that reads loop-only attributes annotates ``ctx: LoopClient`` (never ``Client``): every problem
    the check finds in a sequential-only algorithm's method goes with a ``LoopClient`` annotation of it."""
    for cls in CLASSES:
        problems = contract_problems(cls)
        reads = {p.split(" reads ")[0] for p in problems if " reads " in p}
        annotated = {p.split(" annotates ")[0] for p in problems if " annotates ctx: LoopClient" in p}
        assert reads <= annotated, (cls.__name__, reads - annotated)


class ReadsX(FedAvg):
    """Declares vectorizable but reads the client's raw inputs (what the stacked context has not)."""

    vectorizable = True

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        scale = ctx.x.abs().mean()
        return super().client_update(ctx, {n: v * scale for n, v in global_params.items()}, state)


class AnnotatesLoop(FedAvg):
    vectorizable = True

    def client_update(self, ctx: LoopClient, global_params: Params, state: Params) -> ClientUpdate:
        return super().client_update(ctx, global_params, state)


def loop_helper(ctx: Client) -> int:
    return int(ctx.y.sum())


class HelperAndClosure(FedAvg):
    """Loop-only reads hidden in a module-level helper and in a closure passed to ``sgd``."""

    vectorizable = True

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        shift = loop_helper(ctx)
        draw = lambda: ctx.generator.initial_seed()  # noqa: E731
        return super().client_update(ctx, {n: v + shift + draw() for n, v in global_params.items()}, state)


class VectorizableIFCA(IFCA):
    """A subclass that declares vectorizable over a sequential-only base: the base's methods count."""

    vectorizable = True


class Typo(FedAvg):
    vectorizable = True

    def client_update(self, ctx: Client, global_params: Params, state: Params) -> ClientUpdate:
        ctx.class_sums  # noqa: B018 (a name the contract does not have)
        return super().client_update(ctx, global_params, state)


def test_the_check_finds_each_kind_of_loop_only_use() -> None:
    assert contract_problems(ReadsX) == [
        f"ReadsX.client_update (test_contract.py:{ReadsX.client_update.__code__.co_firstlineno}) reads ctx.x, "
        "which only the sequential loop offers"
    ]
    assert any("annotates ctx: LoopClient" in p for p in contract_problems(AnnotatesLoop))
    problems = contract_problems(HelperAndClosure)
    assert any(p.startswith("loop_helper (") and p.endswith("reads ctx.y, which only the sequential loop offers")
               for p in problems)
    assert any("HelperAndClosure.client_update" in p and "reads ctx.generator" in p for p in problems)
    assert any(p.startswith("IFCA.choose_cluster") and "reads ctx.x" in p for p in contract_problems(VectorizableIFCA))
    assert contract_problems(Typo) == [
        f"Typo.client_update (test_contract.py:{Typo.client_update.__code__.co_firstlineno}) reads ctx.class_sums, "
        "which the client contract lacks"
    ]


def test_a_sequential_only_algorithm_is_not_checked() -> None:
    """``vectorizable`` is not inherited: a subclass of a bad class that does not declare it is left alone."""

    class Quiet(ReadsX):
        vectorizable = False

    check_vectorizable(Quiet)
    check_vectorizable(IFCA)


def test_the_error_is_one_line_before_round_one() -> None:
    """Binding the data (what ``setup`` does before the first round) refuses the algorithm with one line."""
    dm = SyntheticLinearDataModule(num_clients=4, dim=6, rank=2, samples_per_client=5, participation=0.5, seed=0)
    dm.setup("fit")
    module = FederatedModule(ReadsX(1), LinearRepresentation(6, 2), aggregation="uniform")
    with pytest.raises(ConfigError) as error:
        module.attach_data(dm.federated)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("ReadsX declares vectorizable = True but ReadsX.client_update (test_contract.py:")
    assert "reads ctx.x, which only the sequential loop offers" in message
    assert message.endswith("write it against fl_lightning.client.Client only, or declare vectorizable = False")
    FederatedModule(FedAvg(1), LinearRepresentation(6, 2), aggregation="uniform").attach_data(dm.federated)


def test_a_class_is_read_once_and_each_caller_gets_its_own_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from fl_lightning.engine import contract

    class Fresh(Algorithm):
        vectorizable = True

        def client_update(self, ctx, global_params, state):  # noqa: ANN001, ANN201
            return ctx.x

    reads: list[type] = []
    original = contract._class_node
    monkeypatch.setattr(contract, "_class_node", lambda klass: (reads.append(klass), original(klass))[1])
    first = contract_problems(Fresh)
    first.append("changed by a caller")
    again = contract_problems(Fresh)
    assert again == first[:-1] and len(again) == 1 and "reads ctx.x" in again[0]
    assert reads.count(Fresh) == 1
