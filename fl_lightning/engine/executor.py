"""How a round's clients run: the one place that chooses between the sequential loop and the stacked path.

``choose_path`` decides from the algorithm, the network, the device and the workload (how many clients run at
once, with which client optimiser and augmentation), under ``model.executor``:

* ``sequential``: the reference loop (``fl_lightning.engine.sequential.ClientContext``, one client after another);
* ``vectorized``: the stacked path (``fl_lightning.engine.stacked.VectorizedContext``, all clients at once, the
  loop's math) wherever it can run; where it cannot, the loop runs and a WARNING says why, once;
* ``auto`` (the default): the stacked path where it can run and wins on the device (``auto_rule``:
  ``MIN_STACKED_CLIENTS``, ``MIN_TRAINING_RATE``, ``MIN_CONV_MINIBATCHES``), else the loop. Where the stacked path
  would only run its clients in turn (a client optimiser without a batched form, recurrent layers, an augmentation
  that cannot draw ahead) ``auto`` runs the loop.

``decide`` makes the run's decision once: the path, why, and its sub-paths: how the stacked path trains
(``fl_lightning.engine.stacked_paths.StackedPaths``: ``fused relu mlp``, ``conv in turn``, …, which
``VectorizedContext`` reads instead of choosing) and how evaluation and "+FT" score (``evaluation_path``: ``shared
body``, ``stacked`` or ``loop``, which ``fl_lightning.engine.evaluation`` reads). One line per run names it all
(``Decision.describe``), e.g. ``executor: stacked (sgd: fused relu mlp; eval: stacked) because FedAvg is
vectorizable, 4 clients at a time on the cpu``, and ``summary.json``'s ``ran`` records the same
(``Decision.record``). Training (``run_clients``), evaluation and the run axis
(``fl_lightning.experiment.run_axis.cohorts``) all ask ``choose_path``. The functions here take the
``FederatedModule`` (``FederatedRun`` names what they read of it) and never import it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch
from torch import nn

from fl_lightning.algorithms.base import Algorithm, ClientUpdate
from fl_lightning.client import ClientOptimizer, Params, factory_name
from fl_lightning.engine.batched_optim import batched_rule
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.notes import say_once
from fl_lightning.engine.optimizers import RoundOptimizers
from fl_lightning.engine.rounds import CLIENTS_PER_STEP, make_generator
from fl_lightning.engine.sequential import ClientContext, draws_ahead, has_batchnorm
from fl_lightning.engine.stacked import VectorizedContext
from fl_lightning.engine.stacked_nets import has_rnn, per_sample_loss_for, stack, unstack
from fl_lightning.engine.stacked_paths import StackedPaths, caches_features, conv_in_turn, plan_stacked
from fl_lightning.engine.state import split_state

__all__ = [
    "Decision",
    "ExecutorName",
    "Workload",
    "auto_rule",
    "choose_path",
    "client_context",
    "decide",
    "decided",
    "run_clients",
    "simulate_faults",
    "stacked_updates",
    "vector_context",
]

log = logging.getLogger("fl_lightning")

ExecutorName = Literal["auto", "sequential", "vectorized"]
#: how an evaluation scores its clients (``evaluation_path``)
EvalPath = Literal["shared body", "stacked", "loop"]

#: ``auto`` on these devices runs the loop below this many clients at once. Measured on the 2-core development
#: CPU under load from other jobs (one thread; ``time.process_time`` per round of ``run_clients``, median of 8
#: rounds; ratio sequential / stacked, two runs): DigitsMLP FedAvg 1 epoch on the digits split (~72 samples per
#: client): 1 client 0.82-0.91, 2 clients 1.44-1.48, 4 clients 2.46-2.61; 10 samples per client: 1 client
#: 0.60-0.70, 2 clients 1.03-1.21, 4 clients 1.89-1.97, 10 clients 3.07-3.56; FedRep 2+1 epochs, 1 client 0.73,
#: 2 clients 1.40; the quickstart (FedRep 10+1 epochs, 4 clients) 4.31-4.56. Command:
#: ``OMP_NUM_THREADS=1 python -m benchmarks.executor_auto``. Other devices (not measured yet): stacked from 1 client.
MIN_STACKED_CLIENTS: dict[str, int] = {"cpu": 2}
#: ``auto`` on these devices runs the loop for algorithms whose clients train in fewer than this fraction of rounds
#: (``Algorithm.local_training_rate``): the stacked path's gain is per local SGD step, its extra cost (the cohort's
#: stacked client states, and the elementwise work on them, past the CPU's caches) is per round. Measured on the
#: 2-core development CPU under load from other jobs (one thread; mean CPU ms per round of ``run_clients`` over 10
#: rounds, both paths on the same cohorts; FedAvgCNN on CIFAR-shaped data, 10 clients × 40 images, all 10 per
#: round; L2GD with α scaled so that ηλ stays 0.25), sequential / stacked in two runs: FedAvg (rate 1) 1.16 and
#: 1.10; L2GD p = 0.1 (rate 0.9) 1.07 and 1.05; p = 0.5 (rate 0.5) 1.02 and 0.98; p = 0.9 (rate 0.1, its default)
#: 0.92 and 0.97. The floor sits between the tie at 0.5 and the wins at 0.9. Command: ``OMP_NUM_THREADS=1 python -m
#: benchmarks.executor_auto --l2gd --rounds 10``. Other devices: stacked at any rate (an H200 ran L2GD's default
#: 1.53× faster stacked, README).
MIN_TRAINING_RATE: dict[str, float] = {"cpu": 0.75}
#: ``auto`` on these devices runs the loop for a convolutional network whose clients the stacked path would train in
#: turn (``stacked_paths.conv_in_turn``) when the run's clients take fewer than this many minibatches per local epoch
#: on average (``Workload.minibatches``), unless a head-only phase of the algorithm trains on cached features
#: (``Algorithm.head_only_phase``). On ``conv in turn`` the stacked path gains a little per step and pays per round
#: for the cohort's stacked state. Measured on the 2-core development CPU with other jobs running (one thread; CPU
#: time per round of the clients' work, both paths on the same cohorts; FedAvgCNN on CIFAR-shaped data, 20 clients,
#: 10 per round, batch 10), sequential / stacked at 1, 2, 3 and 4 minibatches (10, 20, 30, 40 images per client):
#: ``OMP_NUM_THREADS=1 python -m benchmarks.executor_auto --conv --rounds 8`` (median of 8 rounds; then of 10 with
#: ``--rounds 10``): LocalOnly 0.78, 1.04, 1.04, 1.20 (0.79, 0.99, 1.07, 1.11); LGFedAvg 0.96, 1.05, 1.09, 1.21 (0.79,
#: 1.02, 1.07, 1.25); FedDyn 0.83, 1.01, 1.02, 1.00 (0.94, 1.00, 1.00, 1.01); SCAFFOLD 1.00, 0.97, 1.01, 0.95 (0.86,
#: 1.01, 1.04, 1.00); FedProto 0.86, 0.98, 1.17, 1.13 (0.83, 0.98, 1.04, 1.19); FedRep 2+1 1.79, 1.87, 1.89, 1.91
#: (1.83, 1.86, 1.88, 1.90). ``make bench``'s methods_cnn, seq / auto before this rule (median of 10 rounds;
#: ``OMP_NUM_THREADS=1 python -m benchmarks.bench --device cpu --quick --rounds 10 --workloads methods_cnn --methods
#: LocalOnly LGFedAvg FedDyn SCAFFOLD FedProto --samples N``, N = 10 and 20 at 08ea949, 30 at 3f3323e): 1 minibatch
#: FedAvg 1.02, LocalOnly 0.75, LGFedAvg 0.76, FedDyn 0.82, SCAFFOLD 0.87, FedProto 0.75, FedRep 4.22; 2 minibatches
#: FedAvg 1.11, LocalOnly 0.92, LGFedAvg 0.96, FedDyn 0.98, SCAFFOLD 1.07, FedProto 1.13, FedRep 4.77; 3 minibatches
#: FedAvg 1.11, LocalOnly 1.01, LGFedAvg 1.01, FedDyn 1.01, SCAFFOLD 0.99, FedProto 1.14; 4 (the table's quick size)
#: every method faster or a tie. At 1 minibatch most methods are slower stacked in all three runs; at 2 the bench
#: read LocalOnly and LGFedAvg slower (90 % bands 0.905-0.947 and 0.923-0.981) and executor_auto ties (0.97-1.05);
#: from 3 on none is slower beyond the run-to-run spread of about 5 %. FedAvg at 2 minibatches (1.11 stacked) runs
#: the loop too: the rule has no per-method exception but the cached head. Other devices: stacked (their
#: convolutions are vmapped, not run in turn).
MIN_CONV_MINIBATCHES: dict[str, float] = {"cpu": 3.0}


class FederatedRun(Protocol):
    """What the executor reads of a ``FederatedModule``."""

    algorithm: Algorithm
    net: nn.Module
    fed: FederatedData | None
    executor: ExecutorName
    keep_client_optimizer_state: bool
    run_axis: Any
    loss_fn: Any
    device: torch.device
    client_optimizer: ClientOptimizer
    round_optimizers: RoundOptimizers


@dataclass(frozen=True)
class Workload:
    """What runs at once: ``clients`` (this rank's share of a round's cohort, or of the clients it evaluates)
    and the client ``optimizer`` (None when nothing trains with it: evaluation without "+FT")."""

    clients: int
    optimizer: ClientOptimizer | None = None
    evaluation: bool = False  #: scoring (and "+FT"): the algorithm's ``client_update`` does not run
    augment: Any = None  #: the training augmentation (``FederatedData.augment``)
    #: the run's clients' mean number of minibatches per local epoch (``minibatches_per_epoch``; None: not known)
    minibatches: float | None = None


@dataclass(frozen=True)
class Decision:
    """Which path runs (``sequential`` or ``stacked``) and why; ``fallback``: ``vectorized`` was asked and
    cannot run. ``decide`` adds the run's sub-paths (not compared: they follow from the run): ``paths``, how the
    stacked path trains (``stacked_paths.plan_stacked``; None on the loop), ``evaluation`` and ``finetune``, how the
    periodic evaluation and the run's "+FT" score (``evaluation_path``; None: no "+FT")."""

    path: Literal["sequential", "stacked"]
    reason: str
    fallback: bool = False
    paths: StackedPaths | None = field(default=None, compare=False)
    evaluation: EvalPath | None = field(default=None, compare=False)
    finetune: EvalPath | None = field(default=None, compare=False)
    asked: ExecutorName | None = field(default=None, compare=False)  #: the ``model.executor`` it was made under

    @property
    def stacked(self) -> bool:
        return self.path == "stacked"

    def sub_paths(self) -> str:
        """``sgd: …; eval: …; +FT: …``, the parts ``decide`` filled in."""
        parts = [] if self.paths is None else [f"sgd: {self.paths.describe()}"]
        parts += [] if self.evaluation is None else [f"eval: {self.evaluation}"]
        parts += [] if self.finetune is None else [f"+FT: {self.finetune}"]
        return "; ".join(parts)

    def describe(self) -> str:
        """The run's executor line: ``executor: stacked (sgd: fused relu mlp; eval: stacked) because …``, or
        the fallback of a ``vectorized`` that cannot run."""
        if self.fallback:
            return f"executor 'vectorized' falls back to 'sequential': {self.reason}"
        subs = self.sub_paths()
        return f"executor: {self.path}{f' ({subs})' if subs else ''} because {self.reason}"

    def record(self) -> dict[str, Any]:
        """What ``summary.json``'s ``ran`` carries of the decision (``summary.what_ran``)."""
        return {
            "executor": self.path,
            "reason": self.reason,
            "sgd": None if self.paths is None else self.paths.describe(),
            "eval": self.evaluation,
            "finetune": self.finetune,
        }


def declares_vectorizable(algorithm: Algorithm) -> bool:
    """``vectorizable`` declared by the algorithm's own class (it is not inherited: a subclass may change
    ``client_update``)."""
    return bool(type(algorithm).__dict__.get("vectorizable", False))


def _blocker(algorithm: Algorithm, net: nn.Module, workload: Workload) -> str | None:
    """Why the stacked path cannot run this workload at all, or None."""
    if getattr(net, "stacked_blocker", None):  # a network that says it runs one client at a time (LoRAClassifier)
        return str(net.stacked_blocker)
    if workload.evaluation and getattr(net, "stacked_scoring_blocker", None):  # one that scores one at a time
        return str(net.stacked_scoring_blocker)
    if not workload.evaluation and not declares_vectorizable(algorithm):
        return f"{type(algorithm).__name__} is not marked vectorizable"
    if workload.evaluation and has_batchnorm(net):  # training stacks per-client BatchNorm statistics; scoring not
        return "the network has BatchNorm layers"
    return None


def choose_path(
    algorithm: Algorithm,
    net: nn.Module,
    device: torch.device | str,
    workload: Workload,
    executor: ExecutorName = "auto",
) -> Decision:
    """The path of ``workload`` under ``model.executor`` (see the module docstring): pure, logs nothing."""
    if executor == "sequential":
        return Decision("sequential", "model.executor: sequential")
    blocker = _blocker(algorithm, net, workload)
    if blocker is not None:
        return Decision("sequential", blocker, fallback=executor == "vectorized")
    note = f"; {net.stacked_note}" if getattr(net, "stacked_note", None) else ""  # e.g. LoRA adapters stacked
    if executor == "vectorized":
        return Decision("stacked", f"model.executor: vectorized{note}")
    # where the stacked path would run its clients in turn anyway (and warn), auto runs the loop
    if workload.optimizer is not None and batched_rule(workload.optimizer) is None:
        name = factory_name(workload.optimizer.factory)
        return Decision("sequential", f"client optimizer {name} has no batched form")
    if not workload.evaluation and has_rnn(net):
        return Decision("sequential", "recurrent layers (LSTM) have no batched form")
    if workload.augment is not None and not draws_ahead(workload.augment):
        return Decision("sequential", "the augmentation cannot draw ahead")
    kind, k = torch.device(device).type, workload.clients
    at_once = f"{k} client{'' if k == 1 else 's'} at a time on the {kind}"
    slower = auto_rule(kind, k, None if workload.evaluation else algorithm, workload.minibatches, net)
    if slower is not None:
        return Decision("sequential", f"{at_once}: {slower}")
    what = "evaluation" if workload.evaluation else f"{type(algorithm).__name__} is vectorizable"
    return Decision("stacked", f"{what}, {at_once}{note}")


def auto_rule(
    kind: str,
    clients: int,
    algorithm: Algorithm | None,
    minibatches: float | None = None,
    net: nn.Module | None = None,
) -> str | None:
    """``auto``'s measured rule on a device ``kind`` (where the stacked path can run and would not run its clients
    in turn for a reason): why the loop is faster for ``clients`` at once of ``algorithm`` (None: evaluation,
    nothing trains), whose clients take ``minibatches`` per local epoch on average (None: not known), on ``net``, or
    None where the stacked path is at least as fast (``MIN_STACKED_CLIENTS``, ``MIN_TRAINING_RATE``,
    ``MIN_CONV_MINIBATCHES``: what was measured, with the commands that re-measure it). The minibatch floor applies
    where ``net``'s convolutional phases run client by client on the device (``stacked_paths.conv_in_turn``) and no
    head-only phase of the algorithm trains on cached features (``Algorithm.head_only_phase`` on a network whose
    features are cached, ``stacked_paths.caches_features``)."""
    least = MIN_STACKED_CLIENTS.get(kind, 1)
    if clients < least:
        return f"the loop is faster below {least}"
    rate = 1.0 if algorithm is None else float(algorithm.local_training_rate)
    floor = MIN_TRAINING_RATE.get(kind, 0.0)
    if rate < floor:
        return (f"{type(algorithm).__name__}'s clients train in {rate:.0%} of rounds, and the loop is faster below "
                f"{floor:.0%}")  # fmt: skip
    fewest = MIN_CONV_MINIBATCHES.get(kind, 0.0)
    if algorithm is None or net is None or minibatches is None or minibatches >= fewest:
        return None
    cached_head = algorithm.head_only_phase and caches_features(net, sides=False)
    if conv_in_turn(net, torch.device(kind)) and not cached_head:
        return (f"its clients take {minibatches:.3g} minibatches per epoch on average, and with conv in turn the "
                f"loop is faster below {fewest:g}")  # fmt: skip
    return None


def minibatches_per_epoch(offsets: Sequence[int], batch_size: int, drop_last: bool = False) -> float:
    """The clients' mean number of minibatches of ``batch_size`` in one local epoch (``offsets``: their row offsets,
    ``ClientSplit.offsets``): the partial last minibatch counts, unless ``drop_last`` drops it."""
    sizes = [hi - lo for lo, hi in zip(offsets[:-1], offsets[1:])]
    if not sizes:
        return 0.0
    whole = sum(n // batch_size if drop_last else -(-n // batch_size) for n in sizes)
    return whole / len(sizes)


#: each run's ``minibatches_per_epoch``, with the data and settings it was computed from (once per run)
_MINIBATCHES: weakref.WeakKeyDictionary[Any, tuple[Any, int, bool, float]] = weakref.WeakKeyDictionary()


def run_minibatches(module: FederatedRun, fed: FederatedData, optimizer: ClientOptimizer) -> float:
    """``minibatches_per_epoch`` of the run's clients (``fed.train``) under its client batch size, computed once per
    run (again only if the data or the batch settings change)."""
    held = _MINIBATCHES.get(module)
    if held is not None and held[0] is fed and held[1:3] == (optimizer.batch_size, optimizer.drop_last):
        return held[3]
    value = minibatches_per_epoch(fed.train.offsets, optimizer.batch_size, optimizer.drop_last)
    _MINIBATCHES[module] = (fed, optimizer.batch_size, optimizer.drop_last, value)
    return value


def planned_clients(module: FederatedRun, clients: int) -> int:
    """This rank's share of the configured cohort (``data.clients_per_round``) when the trainer has a
    DataModule, else ``clients``: one decision for the whole run, whatever drops out of a round."""
    trainer = getattr(module, "_trainer", None)
    per_round = getattr(getattr(trainer, "datamodule", None), "clients_per_round", None)
    if not isinstance(per_round, int):
        return clients
    world = max(int(getattr(trainer, "world_size", 1)), 1)
    return -(-per_round // world)


#: each run's training path as first decided (said then, once per run: ``notes.say_once``)
_DECIDED: weakref.WeakKeyDictionary[Any, Decision] = weakref.WeakKeyDictionary()


def decide(module: FederatedRun, clients: int) -> Decision:
    """The training path of ``module``'s rounds (``clients`` run at once) with its sub-paths (``with_sub_paths``),
    said once per run in one line (``Decision.describe``): INFO, or WARNING where the stacked path runs its clients in
    turn for a reason or a ``vectorized`` falls back; with the run's warnings about its clients' minibatches (on every
    path alike). Later calls return the run's first decision while the path stays the same."""
    fed = module.fed
    augment = None if fed is None else fed.augment
    optimizer = client_settings(module)
    minibatches = None if fed is None else run_minibatches(module, fed, optimizer)
    workload = Workload(planned_clients(module, clients), optimizer, augment=augment, minibatches=minibatches)
    decision = choose_path(module.algorithm, module.net, module.device, workload, module.executor)
    first = _DECIDED.get(module)
    if first is not None and first == decision:
        return first
    decision = with_sub_paths(module, decision, optimizer)
    if first is not None:
        return decision
    _DECIDED[module] = decision
    warn = decision.fallback or (decision.paths is not None and decision.paths.why is not None)
    say_once(module.net, "executor", logging.WARNING if warn else logging.INFO, "%s", decision.describe())
    if fed is not None and partial_batchnorm_batches(module.net, optimizer, fed.train.offsets):  # once per run
        say_once(module.net, "bn1d", logging.WARNING, "BatchNorm1d network: a client's last minibatch of 1 sample is "
                 "skipped (BatchNorm cannot train on one sample); model.drop_last: true drops every partial minibatch")
    return decision


def with_sub_paths(module: FederatedRun, decision: Decision, optimizer: ClientOptimizer) -> Decision:
    """``decision`` with the run's sub-paths: how the stacked path trains (``plan_stacked``), how the periodic
    evaluation and the run's "+FT" score (``evaluation_path``, for this rank's share of an evaluation step)."""
    fed = module.fed
    if fed is None:
        return decision
    paths = None
    if decision.stacked:
        paths = plan_stacked(module.net, module.device, optimizer, fed.augment, fed.num_classes is not None,
                             fed.side is not None)  # fmt: skip
    at_once = planned_evaluation_clients(module)
    finetune = getattr(module, "finetune", None)
    return replace(
        decision,
        asked=module.executor,
        paths=paths,
        evaluation=evaluation_path(module, None, at_once),
        finetune=None if finetune is None else evaluation_path(module, finetune, at_once),
    )


def planned_evaluation_clients(module: FederatedRun) -> int:
    """This rank's share of the clients an evaluation step scores at once: the evaluation sample
    (``model.eval_clients``) or every client, in chunks of ``CLIENTS_PER_STEP``."""
    trainer = getattr(module, "_trainer", None)
    world = max(int(getattr(trainer, "world_size", 1)), 1)
    n = module.fed.num_clients
    sample = getattr(module, "eval_clients", None)
    n = n if not isinstance(sample, int) else min(n, sample)
    return max(min(CLIENTS_PER_STEP, -(-n // world)), 1)


def decided(module: FederatedRun) -> Decision | None:
    """The training path ``decide`` chose for ``module``, if its clients have trained."""
    return _DECIDED.get(module)


# ---- evaluation's path ------------------------------------------------------------------------------------------
class Tuning(Protocol):
    """What the evaluation paths read of a ``FineTune``."""

    prefixes: Sequence[str]


def evaluation_stacks(module: FederatedRun, clients: int) -> bool:
    """Whether the executor choice (``choose_path``) stacks ``clients`` evaluating at once."""
    device = next((p.device for p in module.net.parameters()), torch.device("cpu"))
    workload = Workload(clients, evaluation=True)
    return choose_path(module.algorithm, module.net, device, workload, module.executor).stacked


def shared_body_applies(module: FederatedRun, finetune: Tuning | None, clients: int = CLIENTS_PER_STEP) -> bool:
    """The fast path applies when the executor choice stacks ``clients`` evaluating at once (``choose_path``) and
    every client's model is (global body) + (its own head), and the body has no BatchNorm (whose training-mode
    statistics depend on how samples are batched, so "+FT" runs client by client)."""
    kind = type(module.algorithm)
    net = module.net
    return (
        evaluation_stacks(module, clients)
        and isinstance(getattr(net, "body", None), nn.Module)
        and getattr(net, "side", None) is None
        and not has_batchnorm(net)
        and all(p.startswith("head.") for p in module.algorithm.personal)
        and (finetune is None or all(p.startswith("head.") for p in finetune.prefixes))
        and kind.client_model is Algorithm.client_model
        and kind.adapt_for_evaluation is Algorithm.adapt_for_evaluation
        and kind.predict is Algorithm.predict
        and kind.finetune is Algorithm.finetune
    )


def stacked_scoring_applies(
    module: FederatedRun, finetune: Tuning | None, clients: int = CLIENTS_PER_STEP, fed: FederatedData | None = None
) -> bool:
    """Every client's own model (``Algorithm.client_model``) scores its split in one stacked forward when the
    executor choice stacks ``clients`` evaluating at once and nothing runs per client before the forward: no "+FT",
    evaluation-time adaptation only by a vectorizable algorithm (then on the clients stacked), the network's own
    forward as prediction, a classification task, no side branch and no recurrent layer (BatchNorm is refused by
    ``choose_path``). ``fed``: the evaluated data (default: the run's)."""
    kind, net = type(module.algorithm), module.net
    fed = module.fed if fed is None else fed
    adapts = kind.adapt_for_evaluation is not Algorithm.adapt_for_evaluation
    return (
        finetune is None
        and fed.num_classes is not None
        and fed.side is None
        and getattr(net, "side", None) is None
        and not has_rnn(net)
        and (not adapts or declares_vectorizable(module.algorithm))
        and kind.predict is Algorithm.predict
        and evaluation_stacks(module, clients)
    )


def evaluation_path(
    module: FederatedRun, finetune: Tuning | None, clients: int, fed: FederatedData | None = None
) -> EvalPath:
    """How ``clients`` of ``fed`` (default: the run's data) evaluating at once score (fine-tuned first with
    ``finetune``): ``shared body`` (the global body's features once, then every client's head:
    ``shared_body_applies``), ``stacked`` (every client's model in one stacked forward: ``stacked_scoring_applies``)
    or ``loop`` (client by client with its context)."""
    if shared_body_applies(module, finetune, clients):
        return "shared body"
    return "stacked" if stacked_scoring_applies(module, finetune, clients, fed) else "loop"


def evaluation_route(
    module: FederatedRun, finetune: Tuning | None, clients: int, fed: FederatedData | None = None
) -> EvalPath:
    """The path of an evaluation of ``clients`` at once: the run's decided one (``decide``: the periodic
    evaluation and the run's "+FT", on the run's data), else (before the run's first round, another fine-tuning or
    other data: new clients', or another ``model.executor`` than the decision's, as a test sets on a fitted module)
    ``evaluation_path`` now."""
    decision = _DECIDED.get(module)
    own = fed is None or fed is module.fed
    if own and decision is not None and decision.evaluation is not None and decision.asked == module.executor:
        if finetune is None:
            return decision.evaluation
        if finetune is getattr(module, "finetune", None) and decision.finetune is not None:
            return decision.finetune
    return evaluation_path(module, finetune, clients, fed)


def partial_batchnorm_batches(net: nn.Module, optimizer: ClientOptimizer, offsets: Sequence[int]) -> bool:
    """Whether some client's last minibatch holds 1 sample that a ``BatchNorm1d`` network skips (``min_batch``
    2 without ``drop_last``); ``offsets``: the clients' row offsets (``ClientSplit.offsets``)."""
    batch = optimizer.batch_size
    if optimizer.drop_last or optimizer.min_batch(batch, net) != 2:
        return False
    return any((hi - lo) % batch == 1 for lo, hi in zip(offsets[:-1], offsets[1:]))


# ---- contexts ---------------------------------------------------------------------------------------------------
def client_settings(module: FederatedRun) -> ClientOptimizer:
    """The round's client optimiser: ``module.client_optimizer`` at the learning rate the client schedule holds now
    (``RoundOptimizers.client_lr``, which Lightning steps and checkpoints); before fitting, the configured one."""
    holder = module.round_optimizers.client_lr
    if holder is None:
        return module.client_optimizer
    return replace(module.client_optimizer, lr=float(holder.param_groups[0]["lr"]))


def client_context(
    module: FederatedRun,
    client: int,
    round_idx: int,
    split: str = "train",
    tag: str = "train",
    step_budget: float = 1.0,
    fed: FederatedData | None = None,
) -> ClientContext:
    """One client's context on its ``split`` (``train`` or ``test``) of ``fed`` (default: the run's data) with its
    generator ``(seed, tag, round, client)``; the augmentation applies to training data only."""
    fed = module.fed if fed is None else fed
    x, y = (fed.train if split == "train" else fed.test).client(client)
    return ClientContext(
        module.net, client, x, y, None if fed.side is None else fed.side[client],
        client_settings(module), module.loss_fn, make_generator(fed.seed, tag, round_idx, client),
        fed.augment if split == "train" else None, round_idx, fed.seed, step_budget,
    )  # fmt: skip


def vector_context(
    module: FederatedRun, clients: Sequence[int], round_idx: int, budgets: list[float], tag: str = "train",
    fed: FederatedData | None = None,
) -> VectorizedContext:
    """``clients`` stacked in one context on their training data in ``fed`` (default: the run's data; the stacked
    path's ``client_context``), on the run's decided sub-paths (``decide``; a context of a run not decided yet plans
    its own)."""
    decision = _DECIDED.get(module)
    fed = module.fed if fed is None else fed
    pairs = [fed.train.client(c) for c in clients]
    return VectorizedContext(
        module.net, list(clients), [x for x, _ in pairs], [y for _, y in pairs],
        None if fed.side is None else [fed.side[c] for c in clients], client_settings(module),
        per_sample_loss_for(fed.num_classes), [make_generator(fed.seed, tag, round_idx, c) for c in clients],
        fed.augment, round_idx, fed.seed, budgets, paths=None if decision is None else decision.paths,
    )  # fmt: skip


# ---- one round's clients ----------------------------------------------------------------------------------------
def stacked_updates(upd: ClientUpdate, ctx: VectorizedContext, kept: Params, lo: int, hi: int) -> list[ClientUpdate]:
    """Rows ``lo:hi`` of a stacked ``client_update`` as one ``ClientUpdate`` each (views of the stacked results,
    kept optimiser state merged into the state; sizes from the host, losses stay on the device)."""
    return [
        ClientUpdate(
            unstack(upd.upload, k),
            {**unstack(upd.state, k), **unstack(kept, k)},
            ctx.num_samples[k],
            upd.loss[k],
        )
        for k in range(lo, hi)
    ]


def run_clients(
    module: FederatedRun, clients: list[int], round_idx: int, glob: Params, states: list[Params], budgets: list[float]
) -> list[ClientUpdate]:
    """The local updates of ``clients`` on the path ``decide`` chose (a run batched with others hands them to
    its run axis). Kept client optimiser state (``keep_client_optimizer_state``) travels in the contexts, not
    through the algorithm."""
    if not clients:
        return []
    decision = decide(module, len(clients))
    if module.run_axis is not None:  # batched with other runs of this process (fl_lightning.experiment.run_axis)
        return module.run_axis.run_clients(module, clients, round_idx, glob, states, budgets, decision)
    states, kept = zip(*(split_state(st) for st in states))
    keep = module.keep_client_optimizer_state
    if decision.stacked:
        ctx = vector_context(module, clients, round_idx, budgets)
        ctx.optimizer_state = stack(kept) if keep else None
        expanded = {n: v.expand(len(clients), *v.shape) for n, v in glob.items()}
        upd = module.algorithm.client_update(ctx, expanded, stack(states) if states[0] else {})
        return stacked_updates(upd, ctx, ctx.optimizer_state or {}, 0, len(clients))
    updates = []
    for c, st, kept_c, b in zip(clients, states, kept, budgets):
        ctx = client_context(module, c, round_idx, step_budget=b)
        ctx.optimizer_state = kept_c if keep else None
        upd = module.algorithm.client_update(ctx, glob, st)
        if keep:
            upd.state = {**upd.state, **ctx.optimizer_state}
        updates.append(upd)
    return updates


class FaultyRun(Protocol):
    """What ``simulate_faults`` reads of a ``FederatedModule``."""

    fed: FederatedData
    client_dropout: float
    stragglers: float


def simulate_faults(
    module: FaultyRun, round_idx: int, cohort: list[int], mine: list[int]
) -> tuple[set[int], set[int]]:
    """(failed, slow): the positions in ``mine`` whose client fails / straggles this round (seeded coins)."""

    def coin(tag: str, j: int) -> float:
        return float(torch.rand(1, generator=make_generator(module.fed.seed, tag, round_idx, cohort[j])))

    failed = {j for j in mine if module.client_dropout and coin("dropout", j) < module.client_dropout}
    slow = {j for j in mine if module.stragglers and coin("straggler", j) < module.stragglers}
    return failed, slow
