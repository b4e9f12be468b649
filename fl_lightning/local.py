"""What a client does locally: functional forward passes and training phases over chosen parameters.

Each phase runs the client optimiser (``ClientOptimizer``: momentum SGD, or any ``torch.optim`` class from
``model.client_optimizer``), fresh per phase or continuing from the client's kept state (``state_template``).

A client never gets a model copy. It holds a dict ``name -> tensor`` (parameters and buffers) and
runs the one shared network skeleton with ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.errors import ConfigError

Params = dict[str, Tensor]
Penalty = Callable[[Params], Tensor]
#: A minibatch loss ``(params, x, y) -> loss`` that replaces ``ClientContext.loss`` in a training phase (MOON's
#: contrastive term and FedProto's prototype distance need the batch, not only the parameters).
BatchLoss = Callable[[Params, Tensor, Tensor], Tensor]
#: A ``torch.optim`` class with its init args, as a config gives it (``{class_path: torch.optim.Adam, init_args:
#: {lr: 0.001}}``): a function ``params -> Optimizer``. The same type as ``lightning.pytorch.cli.OptimizerCallable``
#: (spelled out here so that importing the engine does not import jsonargparse).
OptimizerCallable = Callable[[Iterable], torch.optim.Optimizer]
#: A ``torch.optim.lr_scheduler`` class with its init args: ``optimizer -> LRScheduler``
#: (``lightning.pytorch.cli.LRSchedulerCallable``).
LRSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
#: Bank names of the kept client optimiser state: ``client_optimizer.<key>.<parameter name>``.
STATE_PREFIX = "client_optimizer."
#: The per-parameter step counter that says whether a kept state exists yet (0: fresh, as torch builds it).
STEPS = "steps"


@dataclass
class ClientOptimizer:
    """The clients' local optimiser for one round.

    ``factory`` builds it (``model.client_optimizer``: any ``torch.optim`` class with its init args); ``None`` is
    momentum SGD with ``lr``, ``momentum`` and ``weight_decay`` (spec 000 §3.2: lr 0.01, momentum 0.5, batch 10).
    ``lr`` is the round's learning rate: it replaces the lr of every parameter group, so an lr schedule over
    rounds only has to set it. ``decay_bias=False`` puts biases in a parameter group without weight decay
    (as the FedRep authors' code does).
    """

    lr: float = 0.01
    momentum: float = 0.5
    weight_decay: float = 0.0
    batch_size: int = 10
    decay_bias: bool = True
    factory: OptimizerCallable | None = None

    @classmethod
    def from_config(
        cls,
        factory: OptimizerCallable | None,
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 0.0,
        batch_size: int = 10,
        decay_bias: bool = True,
    ) -> ClientOptimizer:
        """Settings from the model's config; with a ``factory``, its own init args give lr, momentum and weight
        decay. A factory that cannot build, or cannot step without a closure, is a ``ConfigError``."""
        if factory is None:
            return cls(lr, momentum, weight_decay, batch_size, decay_bias)
        probe = cls(lr, momentum, weight_decay, batch_size, decay_bias, factory).probe()
        hyper = probe.defaults
        momentum, decay = float(hyper.get("momentum", 0.0)), float(hyper.get("weight_decay", 0.0))
        return cls(float(hyper["lr"]), momentum, decay, batch_size, decay_bias, factory)

    def build(self, params: Params, lr: float | None = None) -> torch.optim.Optimizer:
        """The optimiser over the named leaves ``params``, every group at learning rate ``lr`` (default: the
        round's ``self.lr``)."""
        decayed = [v for n, v in params.items() if self.decay_bias or not n.endswith("bias")]
        plain = [v for n, v in params.items() if not self.decay_bias and n.endswith("bias")]
        groups = [g for g in ({"params": decayed}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
        if self.factory is None:
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        else:
            opt = self.factory(groups)
        for group in opt.param_groups:
            group["lr"] = self.lr if lr is None else lr
        return opt

    def probe(self) -> torch.optim.Optimizer:
        """The optimiser over one dummy 2×3 parameter after one step with a zero gradient: its class, its
        hyperparameters (``defaults``) and the shapes of its per-parameter state."""
        leaf = torch.zeros(2, 3, requires_grad=True)
        try:
            opt = self.build({"probe": leaf})
            leaf.grad = torch.zeros_like(leaf)
            opt.step()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"model.client_optimizer: {factory_name(self.factory)} cannot be used: {exc}") from None
        return opt


def factory_name(factory: object) -> str:
    """The class a factory builds: a class, ``functools.partial(cls, ...)``, or a LightningCLI partial
    (``partial(<instantiator>, cls, **init_args)``)."""
    if factory is None:
        return "SGD"
    candidates = [factory, getattr(factory, "func", None), *getattr(factory, "args", ())]
    cls = next((c for c in candidates if isinstance(c, type)), None)
    return cls.__name__ if cls else repr(factory)


def state_template(optimizer: ClientOptimizer, params: Params) -> Params:
    """Zeros for the client optimiser state kept per client (``model.keep_client_optimizer_state``): every
    per-parameter state tensor of ``params`` (named ``client_optimizer.<key>.<parameter>``) and a step counter.

    Only optimisers whose state is elementwise (scalars or tensors shaped like the parameter: SGD, Adam,
    AdamW, Adagrad, RMSprop, …) can be kept this way; others are a ``ConfigError``.
    """
    opt = optimizer.probe()
    probe_state = opt.state[opt.param_groups[0]["params"][0]]
    keys = {}
    for key, value in probe_state.items():
        if not isinstance(value, Tensor):
            continue
        if value.dim() != 0 and value.shape != (2, 3):
            raise ConfigError(
                f"model.keep_client_optimizer_state: {type(opt).__name__} keeps state '{key}' that is not "
                "elementwise; it cannot be kept per client"
            )
        keys[key] = value
    out: Params = {}
    for n, p in params.items():
        out[state_name(STEPS, n)] = torch.zeros((), dtype=torch.long, device=p.device)
        for key, value in keys.items():
            shape = () if value.dim() == 0 else p.shape
            out[state_name(key, n)] = torch.zeros(shape, dtype=value.dtype, device=p.device)
    return out


def split_state(state: Params) -> tuple[Params, Params]:
    """(the algorithm's client state, the kept client optimiser state)."""
    mine = {n: v for n, v in state.items() if n.startswith(STATE_PREFIX)}
    return {n: v for n, v in state.items() if n not in mine}, mine


def state_name(key: str, param: str) -> str:
    return f"{STATE_PREFIX}{key}.{param}"


def state_keys(kept: Params) -> list[str]:
    """The optimiser state keys (``exp_avg``, ``momentum_buffer``, …) present in a kept state."""
    out = []
    for n in kept:
        key = n[len(STATE_PREFIX) :].split(".", 1)[0]
        if key != STEPS and key not in out:
            out.append(key)
    return out


def load_state(opt: torch.optim.Optimizer, leaves: Params, kept: Params) -> None:
    """Give ``opt`` the kept state of every leaf that has stepped before (the others start fresh, as torch
    starts them). Scalar state (Adam's ``step``) goes where torch keeps it: on the CPU unless fused/capturable."""
    keys, names = state_keys(kept), {id(v): n for n, v in leaves.items()}
    for group in opt.param_groups:
        scalar_on_cpu = not (group.get("fused") or group.get("capturable"))
        for leaf in group["params"]:
            name = names[id(leaf)]
            if int(kept[state_name(STEPS, name)]) == 0:
                continue
            state = {key: kept[state_name(key, name)].clone() for key in keys}
            for key, value in state.items():
                if value.dim() == 0:
                    state[key] = value.cpu() if scalar_on_cpu else value.to(leaf.device)
            opt.state[leaf] = state


def save_state(opt: torch.optim.Optimizer, leaves: Params, kept: Params, steps: int) -> Params:
    """``kept`` updated with the state ``opt`` holds for ``leaves`` after a phase of ``steps`` steps."""
    out = dict(kept)
    keys = state_keys(kept)
    for name, leaf in leaves.items():
        state = opt.state.get(leaf, {})
        if steps == 0 or (keys and not state):  # no step, or never a gradient (not in the loss): unchanged
            continue
        counter = state_name(STEPS, name)
        out[counter] = kept[counter] + steps
        for key in keys:
            target = kept[state_name(key, name)]
            out[state_name(key, name)] = state[key].detach().to(target.device, target.dtype).clone()
    return out


def select(names: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    """Names that start with any of ``prefixes`` (``""`` selects everything)."""
    return [n for n in names if any(n.startswith(p) for p in prefixes)]


def loss_fn_for(num_classes: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    """Cross-entropy for classification, ½·MSE for regression (spec 000 eq. 5)."""
    if num_classes is None:
        return lambda out, y: 0.5 * F.mse_loss(out, y)
    return F.cross_entropy


def step_limit(budget: float, epochs: int, num_samples: int, batch_size: int, max_steps: int | None) -> int | None:
    """The number of local steps a client may take: ``max_steps``, capped for a straggler with ``budget`` < 1
    at that fraction of its ``epochs`` epochs of minibatches (at least one step)."""
    if budget >= 1.0:
        return max_steps
    cap = max(1, int(budget * epochs * -(-num_samples // batch_size)))
    return cap if max_steps is None else min(max_steps, cap)


class ClientContext:
    """A client's data, RNG and local optimiser for one round, plus the training phase primitive ``sgd``.

    ``generator`` is seeded from ``(seed, round, client)``, so a client's local update does not depend
    on which process runs it or on what ran before it.
    """

    def __init__(
        self,
        net: nn.Module,
        client: int,
        x: Tensor,
        y: Tensor,
        side: Tensor | None,
        optimizer: ClientOptimizer,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        generator: torch.Generator,
        augment: Callable[[Tensor, torch.Generator], Tensor] | None = None,
        round_idx: int = 0,
        seed: int = 0,
        step_budget: float = 1.0,
        channels_last: bool = False,
    ) -> None:
        self.net, self.client, self.x, self.y, self.side = net, client, x, y, side
        self.optimizer, self.loss_fn, self.generator, self.augment = optimizer, loss_fn, generator, augment
        self.round, self.seed, self.step_budget = round_idx, seed, step_budget
        self.channels_last = channels_last  # conv speed-up used by the vectorized executor; same values
        self.param_names = [n for n, p in net.named_parameters() if p.requires_grad]  # frozen ones never train
        self.train_loss = 0.0
        #: the client's kept optimiser state (``state_template`` names), or None: a fresh optimiser per phase
        self.optimizer_state: Params | None = None

    def params_with(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names under ``prefixes``."""
        return select(self.param_names, prefixes)

    def params_without(self, prefixes: Sequence[str]) -> list[str]:
        """Trainable parameter names not under ``prefixes``."""
        chosen = set(select(self.param_names, prefixes))
        return [n for n in self.param_names if n not in chosen]

    @property
    def num_samples(self) -> int:
        return self.x.shape[0]

    def side_for(self, n: int) -> Tensor | None:
        return None if self.side is None else self.side.expand(n, *self.side.shape)

    def forward(self, params: Params, x: Tensor) -> Tensor:
        return functional_call(self.net, params, (x,), {"side": self.side_for(x.shape[0])}, strict=False)

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        return self.loss_fn(self.forward(params, x), y)

    def batches(self, batch_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled minibatches (augmented if the data have an on-device augmentation)."""
        bs = batch_size or self.optimizer.batch_size
        perm = torch.randperm(self.num_samples, generator=self.generator).to(self.x.device)
        for i in range(0, self.num_samples, bs):
            idx = perm[i : i + bs]
            x = self.x[idx]
            if self.augment is not None:
                x = self.augment(x, self.generator)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, self.y[idx]

    def sgd(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: Penalty | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
        objective: BatchLoss | None = None,
    ) -> Params:
        """Train ``trainable`` for ``epochs`` epochs of minibatches with the client optimiser (momentum SGD unless
        ``model.client_optimizer`` says otherwise); everything else stays frozen.

        A fresh optimiser per phase, so no momentum or weight decay leaks into frozen parameters
        (spec 000 §8.3); with ``optimizer_state`` (kept per client across rounds) each trained parameter
        continues from its own kept state instead. ``penalty(params)`` is added to every minibatch loss
        (FedProx, Ditto, …); ``objective(params, x, y)`` replaces the minibatch loss (MOON, FedProto); ``lr`` overrides
        the round's learning rate. Returns a new dict; ``params`` is not modified.
        """
        out = {n: t.detach().clone() for n, t in params.items()}
        if self.channels_last:
            out = {n: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for n, t in out.items()}
        if not trainable or epochs <= 0:
            return out
        leaves = {n: out[n].requires_grad_(True) for n in trainable}
        opt = self.optimizer.build(leaves, lr)
        if self.optimizer_state is not None:
            load_state(opt, leaves, self.optimizer_state)
        max_steps = step_limit(self.step_budget, epochs, self.num_samples, self.optimizer.batch_size, max_steps)
        steps, loss_sum = 0, 0.0
        for _ in range(epochs):
            for x, y in self.batches():
                opt.zero_grad(set_to_none=True)
                loss = self.loss(out, x, y) if objective is None else objective(out, x, y)
                if penalty is not None:
                    loss = loss + penalty(out)
                loss.backward()
                opt.step()
                loss_sum += float(loss.detach())
                steps += 1
                if max_steps is not None and steps >= max_steps:
                    break
            if max_steps is not None and steps >= max_steps:
                break
        self.train_loss = loss_sum / max(steps, 1)
        if self.optimizer_state is not None:
            self.optimizer_state = save_state(opt, leaves, self.optimizer_state, steps)
        return {n: t.detach() for n, t in out.items()}

    @torch.no_grad()
    def mean_loss(self, params: Params) -> float:
        return float(self.loss(params, self.x, self.y)) if self.num_samples else 0.0
