"""What a client does locally: functional forward passes and training phases over chosen parameters.

Each phase runs the client optimiser (``ClientOptimizer``: momentum SGD, or any ``torch.optim`` class from
``model.client_optimizer``), fresh per phase or continuing from the client's kept state (``state_template``).

A client never gets a model copy. It holds a dict ``name -> tensor`` (parameters and buffers) and
runs the one shared network skeleton with ``torch.func.functional_call``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.errors import ConfigError

log = logging.getLogger(__name__)

Params = dict[str, Tensor]


@dataclass
class Penalty:
    """A term added to every minibatch loss: ``fn(params, data)``.

    ``data`` holds the client's constants the term needs (FedProx's and Ditto's anchor w^t, SCAFFOLD's correction
    c − c_i, Fed-MTL's mean): one client's tensors in a ``ClientContext``, stacked ``[K, ...]`` in the vectorized
    executor, which hands each client its own slice. ``fn`` must read the client only through ``data``.
    Calling a penalty, ``penalty(params)``, evaluates it for one client.
    """

    fn: Callable[[Params, Params], Tensor]
    data: Params = field(default_factory=dict)

    def __call__(self, params: Params) -> Tensor:
        return self.fn(params, self.data)


#: A penalty as ``sgd`` accepts it: a ``Penalty``, or a plain ``params -> Tensor`` function (one client only: the
#: vectorized executor can give it no per-client data).
PenaltyLike = Penalty | Callable[[Params], Tensor]
#: A custom step direction for ``sgd``: ``(params, x, y, mask) -> (gradients of the trained names, the step's loss)``
#: for ONE client, written with ``torch.func`` and ``ctx.batch_loss`` so that the vectorized executor can ``vmap``
#: it (Per-FedAvg's meta-gradient, APFL's two models). ``mask`` marks the real rows of a padded batch.
Gradient = Callable[[Params, Tensor, Tensor, Tensor], tuple[Params, Tensor]]
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
    (as the FedRep authors' code does). ``drop_last`` (``model.drop_last``) skips every minibatch of fewer than
    ``batch_size`` samples (a ``DataLoader(drop_last=True)``), in every phase that does not ask otherwise.
    """

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
        lr: float = 0.01,
        momentum: float = 0.5,
        weight_decay: float = 0.0,
        batch_size: int = 10,
        decay_bias: bool = True,
        drop_last: bool = False,
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


def has_batchnorm1d(net: nn.Module) -> bool:
    """Whether ``net`` has a ``BatchNorm1d`` layer (training mode needs more than one value per channel)."""
    return any(isinstance(m, nn.BatchNorm1d) for m in net.modules())


_WARNED: set[str] = set()  #: one-line warnings already given in this process


def warn_once(key: str, message: str) -> None:
    """``log.warning(message)`` the first time ``key`` is seen in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


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
            # scalar state (Adam's ``step``) keeps torch's scalar dtype; elementwise state takes the parameter's
            shape, dtype = ((), value.dtype) if value.dim() == 0 else (p.shape, p.dtype)
            out[state_name(key, n)] = torch.zeros(shape, dtype=dtype, device=p.device)
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
            name = names.get(id(leaf))
            if name is None or int(kept[state_name(STEPS, name)]) == 0:
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


def steps_per_epoch(num_samples: int, batch_size: int, min_batch: int = 1) -> int:
    """Minibatches of an epoch that are stepped on: every full batch, and the last partial one if it has at least
    ``min_batch`` samples (``min_batch = 1``: ⌈n / batch size⌉)."""
    rest = num_samples % batch_size
    return num_samples // batch_size + (1 if rest and rest >= min_batch else 0)


def step_limit(
    budget: float, epochs: int, num_samples: int, batch_size: int, max_steps: int | None, min_batch: int = 1
) -> int | None:
    """The number of local steps a client may take: ``max_steps``, capped for a straggler with ``budget`` < 1
    at that fraction of its ``epochs`` epochs of minibatches (at least one step)."""
    if budget >= 1.0:
        return max_steps
    cap = max(1, int(budget * epochs * steps_per_epoch(num_samples, batch_size, min_batch)))
    return cap if max_steps is None else min(max_steps, cap)


def per_client(value: Tensor | float, like: Tensor) -> Tensor | float:
    """A number per client shaped to broadcast against ``like`` (and in its dtype): a plain number or a 0-d tensor
    (one client) as it is, a ``[K]`` tensor (K stacked clients, ``like`` is ``[K, ...]``) as ``[K, 1, …, 1]``."""
    if not isinstance(value, Tensor):
        return value
    value = value.to(like.dtype)
    return value if value.dim() == 0 else value.view(-1, *([1] * (like.dim() - 1)))


def epoch_draws(
    n: int, generator: torch.Generator, augment: Callable | None
) -> tuple[Tensor, Tensor | None]:
    """One epoch's random draws of a client, made at once on the CPU generator: the shuffle (``randperm``) and,
    when the augmentation can draw ahead (``augment.draw(n, generator)``), its parameters for all ``n`` samples
    in shuffled order. Both executors draw exactly these numbers, so a client's batches are a pure function of
    (seed, round, client) on any device."""
    perm = torch.randperm(n, generator=generator)
    return perm, augment.draw(n, generator) if draws_ahead(augment) else None


def draws_ahead(augment: Callable | None) -> bool:
    """Whether an augmentation separates its random draws (``draw``) from applying them (``apply``)."""
    return augment is not None and hasattr(augment, "draw") and hasattr(augment, "apply")


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on ``device``; to a GPU through pinned memory without blocking the host (no sync)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class ClientContext:
    """A client's data, RNG and local optimiser for one round, plus the training phase primitive ``sgd``.

    ``generator`` is seeded from ``(seed, round, client)``, so a client's local update does not depend
    on which process runs it or on what ran before it. Nothing here reads a device tensor back to the host:
    losses are summed on the device, and each epoch's random draws are made at once (``epoch_draws``).
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
        #: the mean minibatch loss of the last ``sgd`` phase (a 0-d tensor on the data's device)
        self.train_loss: Tensor | float = 0.0
        #: the minibatch steps the last ``sgd`` phase took (a 0-d tensor)
        self.steps_taken: Tensor = torch.zeros((), dtype=torch.long)
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

    def batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """The loss of one minibatch for a ``Gradient`` function; ``mask`` is ignored (a client's own batches
        are never padded; the vectorized executor's are)."""
        return self.loss(params, x, y)

    def batches(self, batch_size: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """One epoch of shuffled minibatches (augmented if the data have an on-device augmentation). The epoch's
        draws are made when iteration starts, all at once, and moved to the device in one copy."""
        bs = batch_size or self.optimizer.batch_size
        perm, drawn = epoch_draws(self.num_samples, self.generator, self.augment)
        perm = to_device(perm, self.x.device)
        drawn = None if drawn is None else to_device(drawn, self.x.device)
        for i in range(0, self.num_samples, bs):
            idx = perm[i : i + bs]
            x = self.x[idx]
            if drawn is not None:
                x = self.augment.apply(x, drawn[i : i + bs])
            elif self.augment is not None:  # an augmentation that cannot draw ahead draws per batch
                x = self.augment(x, self.generator)
            if self.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            yield x, self.y[idx]

    def sgd(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: PenaltyLike | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
        *,
        gradient: Gradient | None = None,
        batch_size: int | None = None,
        min_batch: int | None = None,
        objective: BatchLoss | None = None,
    ) -> Params:
        """Train ``trainable`` for ``epochs`` epochs of minibatches with the client optimiser (momentum SGD unless
        ``model.client_optimizer`` says otherwise); everything else stays frozen.

        A fresh optimiser per phase, so no momentum or weight decay leaks into frozen parameters
        (spec 000 §8.3); with ``optimizer_state`` (kept per client across rounds) each trained parameter
        continues from its own kept state instead. ``penalty(params)`` is added to every minibatch loss
        (FedProx, Ditto, …); ``objective(params, x, y)`` replaces the minibatch loss (MOON, FedProto); ``lr``
        overrides the round's learning rate. ``gradient`` replaces the minibatch loss's gradient by another step
        direction (Per-FedAvg, APFL); batches of ``batch_size`` (default: the client optimiser's) with fewer than
        ``min_batch`` samples are skipped (default: ``ClientOptimizer.min_batch``, i.e. ``model.drop_last``).
        Returns a new dict; ``params`` is
        not modified. ``train_loss`` and ``steps_taken`` describe the phase.
        """
        out = {n: t.detach().clone() for n, t in params.items()}
        if self.channels_last:
            out = {n: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for n, t in out.items()}
        if not trainable or epochs <= 0:
            return out
        if penalty is not None and not isinstance(penalty, Penalty):
            penalty = Penalty(lambda p, _, fn=penalty: fn(p))
        leaves = {n: out[n].requires_grad_(True) for n in trainable}
        opt = self.optimizer.build(leaves, lr)
        kept = None if self.optimizer_state is None else {n: v for n, v in leaves.items() if kept_name(n, self)}
        if kept:
            load_state(opt, kept, self.optimizer_state)
        bs = batch_size or self.optimizer.batch_size
        if min_batch is None:
            min_batch = self.optimizer.min_batch(bs, self.net)
            if not self.optimizer.drop_last and min_batch == 2 and self.num_samples % bs == 1:
                warn_once(
                    "bn1d",
                    "BatchNorm1d network: a client's last minibatch of 1 sample is skipped (BatchNorm "
                    "cannot train on one sample); model.drop_last: true drops every partial minibatch",
                )
        limit = step_limit(self.step_budget, epochs, self.num_samples, bs, max_steps, min_batch)
        steps, loss_sum = 0, torch.zeros((), device=self.x.device)
        for _ in range(epochs):
            if limit is not None and steps >= limit:
                break
            for x, y in self.batches(bs):
                if x.shape[0] < min_batch:
                    continue
                opt.zero_grad(set_to_none=True)
                if gradient is None:
                    loss = self.loss(out, x, y) if objective is None else objective(out, x, y)
                    if penalty is not None:
                        loss = loss + penalty(out)
                    loss.backward()
                else:
                    loss = self._set_gradient(gradient, penalty, out, leaves, x, y)
                opt.step()
                loss_sum = loss_sum + loss.detach()
                steps += 1
                if limit is not None and steps >= limit:
                    break
        self.train_loss = loss_sum / max(steps, 1)
        self.steps_taken = torch.tensor(steps)
        if kept:
            self.optimizer_state = save_state(opt, kept, self.optimizer_state, steps)
        return {n: t.detach() for n, t in out.items()}

    def _set_gradient(
        self, gradient: Gradient, penalty: Penalty | None, out: Params, leaves: Params, x: Tensor, y: Tensor
    ) -> Tensor:
        """``leaf.grad`` from a custom step direction (plus the penalty's gradient); returns the step's loss."""
        values = {n: t.detach() for n, t in out.items()}
        grads, loss = gradient(values, x, y, torch.ones(x.shape[0], device=x.device))
        if penalty is not None:
            extra = torch.func.grad(lambda p: penalty({**values, **p}))({n: values[n] for n in leaves})
            grads = {n: grads[n] + extra[n] for n in leaves}
        for n, leaf in leaves.items():
            leaf.grad = grads[n].detach()
        return loss

    @torch.no_grad()
    def mean_loss(self, params: Params) -> Tensor:
        """The loss of ``params`` on all of the client's training data (a 0-d tensor)."""
        if not self.num_samples:
            return torch.zeros((), device=self.x.device)
        return self.loss(params, self.x, self.y).detach()


def kept_name(name: str, ctx: ClientContext) -> bool:
    """Whether the kept optimiser state has an entry for ``name`` (trained names outside the model, like APFL's
    local model, start fresh every phase)."""
    return state_name(STEPS, name) in ctx.optimizer_state
