"""The client contract, and only it: what ``ctx`` offers an algorithm (with ``algorithms/base.py``, all it reads).

``Client``: what both executors offer (one client in the sequential loop, K clients stacked ``[K, ...]``);
``LoopClient``: what only the loop adds (raw data, generator; ``vectorizable = False``). ``ctx.sgd`` runs a phase
of the ``ClientOptimizer`` with a ``Penalty``, a ``Gradient`` step direction or an ``Objective``. Implementations
(never imported by an algorithm): ``engine.sequential.ClientContext``, ``engine.stacked.VectorizedContext``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Protocol

import torch
from torch import Tensor, nn

from fl_lightning.errors import ConfigError

Params = dict[str, Tensor]


class Client(Protocol):
    """What ``ctx`` offers an algorithm's client hooks on both executors (stacked: tensors ``[K, ...]``, per-client
    numbers lists or ``[K]`` tensors). Written only against it and dict operations: ``vectorizable = True``.
    Functions passed into ``sgd`` (``Objective.fn``, ``Gradient``, ``Penalty.fn``) see ONE client (inside ``vmap``
    when stacked): there ``forward``, ``loss``, ``per_sample_loss``, ``batch_loss``, ``side_for`` are one client's,
    and per-client constants travel in a ``Penalty``'s or ``Objective``'s ``data``."""

    net: nn.Module  #: the one shared network skeleton; parameters always come from a ``name -> tensor`` dict
    param_names: list[str]  #: the trainable parameters' names (``requires_grad``), in the network's order
    optimizer: ClientOptimizer  #: the round's client optimiser settings (``lr``, ``batch_size``, ``build``)
    optimizer_state: Params | None  #: the client's kept optimiser state or None; ``sgd`` reads and updates it
    round: int  #: the communication round (and ``seed``, the run's seed)
    seed: int
    step_budget: float | list[float]  #: the straggler budget: the share (≤ 1) of its local steps a client may take
    train_loss: Tensor | float  #: the mean minibatch loss of the last ``sgd`` phase (``[K]`` stacked)
    steps_taken: Tensor  #: the minibatch steps of the last ``sgd`` phase (``[K]`` stacked)
    #: (per-class sums, counts) of the last phase's ``Objective.collect`` values over its last epoch, or None
    class_sums_seen: tuple[Tensor, Tensor] | None

    @property
    def num_samples(self) -> int | list[int]:
        """The client's number of training samples (one per client stacked)."""

    def params_with(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names under ``prefixes``."""

    def params_without(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names not under ``prefixes``."""

    def side_for(self, n: int) -> Tensor | None:
        """One client's side information for a batch of ``n`` samples (None without a side branch)."""

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """One client's network outputs for ``x`` with ``params`` (its side information included)."""

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """One client's mean loss of the network with ``params`` on ``(x, y)``."""

    def per_sample_loss(self, out: Tensor, y: Tensor) -> Tensor:
        """The task loss of each sample ``[B]`` for outputs ``out`` (cross-entropy, or ½·MSE per sample)."""

    def batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """One client's mean loss over the real rows (``mask``) of a possibly padded batch, for a ``Gradient``."""

    def label_counts(self, num_classes: int) -> Tensor:
        """The client's training samples per class: ``[C]`` (``[K, C]`` stacked)."""

    def mean_loss(self, params: Params) -> Tensor:
        """The loss of ``params`` on all of the client's training data (``[K]`` stacked)."""

    def full_gradient(self, params: Params, names: Sequence[str]) -> Params:
        """The gradient for ``names`` of the client's mean loss on all its training data (zeros without data)."""

    def sgd(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: PenaltyLike | None = None,
        lr: float | None = None,
        max_steps: MaxSteps = None,
        *,
        gradient: Gradient | None = None,
        batch_size: int | None = None,
        min_batch: int | None = None,
        objective: Objective | None = None,
    ) -> Params:
        """A phase: ``epochs`` epochs of shuffled minibatches of the client optimiser over ``trainable`` (the rest
        frozen; a fresh optimiser unless ``optimizer_state`` is kept). ``penalty`` is added to each minibatch loss,
        ``objective`` replaces it, ``gradient`` its gradient; batches under ``min_batch`` samples are skipped;
        ``max_steps`` caps the steps. Returns new parameters (``params`` unchanged, BatchNorm buffers updated)."""


class LoopClient(Client, Protocol):
    """What only the sequential loop adds to ``Client``: ONE client's raw data and random stream. An algorithm that
    reads it (closed-form solves, server state indexed by client) annotates it, with ``vectorizable = False``."""

    client: int  #: the client's index
    x: Tensor  #: its training inputs ``[n, ...]``
    y: Tensor  #: its training targets ``[n]``
    side: Tensor | None  #: its side information (None without a side branch)
    generator: torch.Generator  #: its random stream, seeded from ``(seed, round, client)``

    def batches(self, batch_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled (augmented) minibatches, drawn from ``generator``."""


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and machines)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (e.g. ``(seed, tag, round, client)``): a client's, or an algorithm's
    own, random stream that does not depend on which process runs it or what ran before."""
    return torch.Generator().manual_seed(derive_seed(*parts))


@dataclass
class Penalty:
    """A term added to every minibatch loss: ``fn(params, data)``; ``penalty(params)`` evaluates it for one client.

    ``data`` holds the client's constants the term needs (FedProx's and Ditto's anchor w^t, SCAFFOLD's correction
    c − c_i): one client's tensors in the sequential loop, stacked ``[K, ...]`` on the stacked path, which hands
    each client its own slice. ``fn`` must read the client only through ``data``."""

    fn: Callable[[Params, Params], Tensor]
    data: Params = field(default_factory=dict)
    #: ``(params, data) -> {name: ∂fn/∂name}``, when the term's gradient is known in closed form (a proximal term's
    #: λ(w − w^t)): ``sgd`` then adds it to the minibatch gradient and evaluates ``fn`` only for the reported loss,
    #: without an autograd pass through the term. Names it leaves out get no gradient from the term.
    gradient: Callable[[Params, Params], Params] | None = None

    def __call__(self, params: Params) -> Tensor:
        return self.fn(params, self.data)


@dataclass
class Objective:
    """A minibatch loss replacing the network's in a phase: ``fn(params, x, y, data)`` returns ONE client's
    per-sample losses ``[B]`` (or ``(losses, logged)``: ``train_loss`` then averages ``logged``, e.g. FedRoD's
    personal head's loss); ``sgd`` takes their mean over the batch's real rows. Written for one client with
    ``torch.func``-compatible operations and ``ctx.forward`` / ``per_sample_loss`` / ``side_for``, it runs inside
    ``vmap`` on the stacked path. ``data`` holds the client's constants (MOON's fixed models, FedRoD's class
    prior), as ``Penalty.data``."""

    fn: Callable[[Params, Tensor, Tensor, Params], Tensor | tuple[Tensor, ...]]
    data: Params = field(default_factory=dict)
    #: ``(classes, width)``: ``fn`` returns a third element, per-sample values ``[B, width]`` (FedProto's features
    #: φ(x), computed by the training pass anyway), whose sums per class of ``y`` over the phase's last epoch (the
    #: batches of the last epoch that took a step) ``sgd`` leaves in ``ctx.class_sums_seen`` with their counts.
    collect: tuple[int, int] | None = None

    def losses(self, params: Params, x: Tensor, y: Tensor, data: Params | None = None) -> tuple[Tensor, ...]:
        """(per-sample losses, per-sample logged values[, per-sample values to collect]) of one client's batch;
        the logged values are the losses themselves (the same object) when ``fn`` reports nothing else."""
        out = self.fn(params, x, y, self.data if data is None else data)
        if not isinstance(out, tuple):
            return out, out
        return (out[0], out[0], *out[2:]) if out[1] is None else out


#: A penalty as ``sgd`` accepts it: a ``Penalty``, or a plain ``params -> Tensor`` function (one client only: the
#: vectorized executor can give it no per-client data).
PenaltyLike = Penalty | Callable[[Params], Tensor]
#: A custom step direction for ``sgd``: ``(params, x, y, mask) -> (gradients of the trained names, the step's loss)``
#: for ONE client, written with ``torch.func`` and ``ctx.batch_loss`` so that the vectorized executor can ``vmap``
#: it (Per-FedAvg's meta-gradient, APFL's two models). ``mask`` marks the real rows of a padded batch. It may return
#: a third element, ``{name: value}`` for untrained names of ``params`` that the step sets (pFedMe's personal model
#: θ̃, carried from one step to the next).
Gradient = Callable[[Params, Tensor, Tensor, Tensor], tuple[Params, Tensor] | tuple[Params, Tensor, Params]]
#: ``sgd``'s step cap: a number, or ``(num_samples, step_budget) -> steps`` giving each client its own.
MaxSteps = int | Callable[[int, float], int] | None
#: A ``torch.optim`` class with its init args, as a config gives it (``{class_path: torch.optim.Adam, init_args:
#: {lr: 0.001}}``): a function ``params -> Optimizer``. The same type as ``lightning.pytorch.cli.OptimizerCallable``
#: (spelled out here so that importing the engine does not import jsonargparse).
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]


@dataclass
class ClientOptimizer:
    """The clients' local optimiser for one round. ``factory`` builds it (``model.client_optimizer``: any
    ``torch.optim`` class with its init args); ``None`` is momentum SGD with ``lr``, ``momentum`` and
    ``weight_decay`` (spec 000 §3.2: lr 0.01, momentum 0.5, batch 10). ``lr`` is the round's learning rate: it
    replaces every parameter group's, so an lr schedule over rounds only sets it. ``decay_bias=False`` puts biases
    in a group without weight decay (as the FedRep authors' code does). ``drop_last`` (``model.drop_last``) skips
    every minibatch under ``batch_size`` samples, in every phase that does not ask otherwise."""

    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    batch_size: int = 10
    decay_bias: bool = True
    factory: OptimizerCallable | None = None
    drop_last: bool = False

    @classmethod
    def from_config(
        cls,
        factory: OptimizerCallable | None,
        lr: float = lr,  # the defaults are the fields' above, written once
        momentum: float = momentum,
        weight_decay: float = weight_decay,
        batch_size: int = batch_size,
        decay_bias: bool = decay_bias,
        drop_last: bool = drop_last,
    ) -> ClientOptimizer:
        """Settings from the model's config; with a ``factory``, its own init args give lr, momentum and weight
        decay. A factory that cannot build, or cannot step without a closure, is a ``ConfigError``."""
        if factory is None:
            return cls(lr, momentum, weight_decay, batch_size, decay_bias, drop_last=drop_last)
        probe = cls(lr, momentum, weight_decay, batch_size, decay_bias, factory).probe()
        hyper = probe.defaults
        momentum, decay = float(hyper.get("momentum", 0.0)), float(hyper.get("weight_decay", 0.0))
        return cls(float(hyper["lr"]), momentum, decay, batch_size, decay_bias, factory, drop_last)

    def min_batch(self, batch_size: int, net: nn.Module | None = None) -> int:
        """A phase's default ``min_batch`` for batches of ``batch_size``: all of it with ``drop_last``; else 2 for
        a network with ``BatchNorm1d`` (which cannot normalise one sample in training mode: that batch is
        skipped, and the run says so once), else 1 (every batch trains)."""
        if self.drop_last:
            return batch_size
        return 2 if net is not None and has_batchnorm1d(net) else 1

    def build(self, params: Params, lr: float | None = None, fused: bool = False) -> torch.optim.Optimizer:
        """The optimiser over the named leaves ``params``, every group at learning rate ``lr`` (default: the
        round's ``self.lr``). ``fused``: the default SGD steps with torch's fused kernel (one pass over each
        tensor; the same update up to rounding)."""
        decayed = [v for n, v in params.items() if self.decay_bias or not n.endswith("bias")]
        plain = [v for n, v in params.items() if not self.decay_bias and n.endswith("bias")]
        groups = [g for g in ({"params": decayed}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
        if self.factory is None:
            opt = torch.optim.SGD(
                groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, fused=fused or None
            )
        else:
            opt = self.factory(groups)
        for group in opt.param_groups:
            group["lr"] = self.lr if lr is None else lr
        return opt

    def probe(self) -> torch.optim.Optimizer:
        """The optimiser over a dummy 2×3 parameter after a zero-gradient step (class, ``defaults``, state)."""
        leaf = torch.zeros(2, 3, requires_grad=True)
        try:
            opt = self.build({"probe": leaf})
            leaf.grad = torch.zeros_like(leaf)
            opt.step()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"model.client_optimizer: {factory_name(self.factory)} cannot be used: {exc}") from None
        return opt


def has_batchnorm1d(net: nn.Module) -> bool:
    """Whether ``net`` has a ``BatchNorm1d`` layer (training mode needs more than one value per channel)."""
    return any(isinstance(m, nn.BatchNorm1d) for m in net.modules())


def factory_name(factory: object) -> str:
    """The class a factory builds: a class, ``partial(cls, ...)`` or LightningCLI's ``partial(<instantiator>, cls)``."""
    if factory is None:
        return "SGD"
    candidates = [factory, getattr(factory, "func", None), *getattr(factory, "args", ())]
    cls = next((c for c in candidates if isinstance(c, type)), None)
    return cls.__name__ if cls else repr(factory)


def name_matches(name: str, pattern: str) -> bool:
    """Whether parameter ``name`` falls under ``pattern``: a name prefix (``head.``; ``""`` matches everything), or,
    when the pattern has a wildcard (``*``, ``?``, ``[``), a glob that matches the name or one of its dotted prefixes
    (``*.lora_B`` matches ``body.lm.….query.lora_B.default.weight``; ``classifier.*`` matches ``classifier.weight``)."""
    if not any(c in pattern for c in "*?["):
        return name.startswith(pattern)
    parts = name.split(".")
    return any(fnmatchcase(".".join(parts[:k]), pattern) for k in range(len(parts), 0, -1))


def select(names: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    """Names under any of ``prefixes`` (``name_matches``: prefixes or glob patterns; ``""`` selects everything)."""
    return [n for n in names if any(name_matches(n, p) for p in prefixes)]


def per_client(value: Tensor | float, like: Tensor) -> Tensor | float:
    """A number per client shaped to broadcast against ``like`` (and in its dtype): a plain number or a 0-d tensor
    (one client) as it is, a ``[K]`` tensor (K stacked clients, ``like`` is ``[K, ...]``) as ``[K, 1, …, 1]``."""
    if not isinstance(value, Tensor):
        return value
    value = value.to(like.dtype)
    return value if value.dim() == 0 else value.view(-1, *([1] * (like.dim() - 1)))
