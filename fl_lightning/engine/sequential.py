"""The sequential implementation of the client contract (``fl_lightning.client.LoopClient``): ONE client's data, RNG
and local optimiser for one round, and the training phase primitive ``sgd``. It is the reference the stacked path
(``fl_lightning.engine.stacked.VectorizedContext``) is tested against, and the helpers both share: the epoch's random
draws, step caps, per-class sums, the kept client optimiser state and ``FunctionalBatchNorm``.

A client never gets a model copy. It holds a dict ``name -> tensor`` (parameters and buffers) and runs the one shared
network skeleton with ``torch.func.functional_call``. Each phase runs the client optimiser (``ClientOptimizer``:
momentum SGD, or any ``torch.optim`` class from ``model.client_optimizer``), fresh per phase or continuing from the
client's kept state (``state_template``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer, Gradient, MaxSteps, Objective, Params, Penalty, PenaltyLike, select
from fl_lightning.engine.state import STATE_PREFIX, STEPS, state_name
from fl_lightning.errors import ConfigError


class ClientContext:
    """A client's data, RNG and local optimiser for one round, plus the training phase primitive ``sgd``: the
    sequential reference implementation of the client contract (``LoopClient``, which extends ``Client``).

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
        self.frozen_names = frozenset(n for n, p in net.named_parameters() if not p.requires_grad)
        #: the mean minibatch loss of the last ``sgd`` phase (a 0-d tensor on the data's device)
        self.train_loss: Tensor | float = 0.0
        #: the minibatch steps the last ``sgd`` phase took (a 0-d tensor)
        self.steps_taken: Tensor = torch.zeros((), dtype=torch.long)
        #: the client's kept optimiser state (``state_template`` names), or None: a fresh optimiser per phase
        self.optimizer_state: Params | None = None
        #: (per-class sums, per-class counts) of an ``Objective.collect`` over the last phase's last epoch
        self.class_sums_seen: tuple[Tensor, Tensor] | None = None
        self._batchnorm: FunctionalBatchNorm | None = None  # BatchNorm without in-place updates, in a ``Gradient``

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

    def per_sample_loss(self, out: Tensor, y: Tensor) -> Tensor:
        """The loss of each sample ``[B]`` (their mean is ``loss_fn(out, y)``)."""
        if self.loss_fn is F.cross_entropy:
            return F.cross_entropy(out, y, reduction="none")
        return torch.vmap(lambda o, t: self.loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, y)

    def label_counts(self, num_classes: int) -> Tensor:
        """How many training samples the client has of each class ``[num_classes]``."""
        return torch.bincount(self.y, minlength=num_classes)

    def batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """The loss of one minibatch for a ``Gradient`` function; ``mask`` is ignored (a client's own batches
        are never padded; the vectorized executor's are)."""
        if self._batchnorm is None:
            return self.loss(params, x, y)
        with self._batchnorm.rows(torch.ones(x.shape[0], device=x.device)):
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
        max_steps: MaxSteps = None,
        *,
        gradient: Gradient | None = None,
        batch_size: int | None = None,
        min_batch: int | None = None,
        objective: Objective | None = None,
    ) -> Params:
        """Train ``trainable`` for ``epochs`` epochs of minibatches with the client optimiser (momentum SGD unless
        ``model.client_optimizer`` says otherwise); everything else stays frozen.

        A fresh optimiser per phase, so no momentum or weight decay leaks into frozen parameters
        (spec 000 §8.3); with ``optimizer_state`` (kept per client across rounds) each trained parameter
        continues from its own kept state instead. ``penalty(params)`` is added to every minibatch loss
        (FedProx, Ditto, …; with ``Penalty.gradient`` as a gradient term); ``objective`` replaces the minibatch
        loss (MOON, FedProto, FedRoD); ``lr`` overrides the round's learning rate. ``gradient`` replaces the
        minibatch loss's gradient by another step direction (Per-FedAvg, APFL, pFedMe); batches of ``batch_size``
        (default: the client optimiser's) with fewer than ``min_batch`` samples are skipped (default:
        ``ClientOptimizer.min_batch``, i.e. ``model.drop_last``); ``max_steps`` caps the
        steps (a function of the client's size and straggler budget gives each client its own cap). Returns a new
        dict (buffers such as BatchNorm statistics updated as the forward passes update them); ``params`` is not
        modified. ``train_loss`` and ``steps_taken`` describe the phase.
        """
        # parameters frozen in the network (a pretrained base under LoRA adapters) never change: not copied
        out = {n: t.detach() if n in self.frozen_names else t.detach().clone() for n, t in params.items()}
        if self.channels_last:
            out = {n: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for n, t in out.items()}
        collect = None if objective is None else objective.collect
        self.class_sums_seen = None if collect is None else empty_class_sums(collect, self.x.device)
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
        if callable(max_steps):
            max_steps = max_steps(self.num_samples, self.step_budget)
        if min_batch is None:  # a skipped 1-sample BatchNorm1d batch is said once per run (executor.decide)
            min_batch = self.optimizer.min_batch(bs, self.net)
        limit = step_limit(self.step_budget, epochs, self.num_samples, bs, max_steps, min_batch)
        steps, loss_sum = 0, torch.zeros((), device=self.x.device)
        seen = self.class_sums_seen
        for _ in range(epochs):
            if limit is not None and steps >= limit:
                break
            first = True
            for x, y in self.batches(bs):
                if x.shape[0] < min_batch:
                    continue
                opt.zero_grad(set_to_none=True)
                if gradient is None:
                    loss, logged, *values = self._loss_and_logged(objective, out, x, y)
                    loss = self._backward(loss, penalty, out, leaves)
                    loss = loss if logged is None else logged
                    if seen is not None:  # the last epoch's values: start again at each epoch's first step
                        seen = empty_class_sums(collect, self.x.device, values[0].dtype) if first else seen
                        class_sum_step(seen, values[0], y)
                    first = False
                else:
                    loss = self._set_gradient(gradient, penalty, out, leaves, x, y)
                opt.step()
                loss_sum = loss_sum + loss.detach()
                steps += 1
                if limit is not None and steps >= limit:
                    break
        self.train_loss = loss_sum / max(steps, 1)
        self.steps_taken = torch.tensor(steps)
        self.class_sums_seen = seen
        if kept:
            self.optimizer_state = save_state(opt, kept, self.optimizer_state, steps)
        return {n: t.detach() for n, t in out.items()}

    def _loss_and_logged(self, objective: Objective | None, out: Params, x: Tensor, y: Tensor) -> tuple:
        """The minibatch loss (the network's, or the objective's mean), the objective's logged value (None: the
        loss), and the per-sample values it collects, if any."""
        if objective is None:
            return self.loss(out, x, y), None
        per, logged, *values = objective.losses(out, x, y)
        return per.mean(), None if logged is per else logged.mean(), *values

    @staticmethod
    def _backward(loss: Tensor, penalty: Penalty | None, out: Params, leaves: Params) -> Tensor:
        """``leaf.grad`` of loss + penalty (the penalty's closed-form gradient added when it has one); returns the
        step's loss value."""
        if penalty is None or penalty.gradient is None:
            loss = loss if penalty is None else loss + penalty(out)
            loss.backward()
            return loss
        loss.backward()
        with torch.no_grad():
            add_gradient(leaves, penalty.gradient(out, penalty.data))
            return loss.detach() + penalty(out)

    def _set_gradient(
        self, gradient: Gradient, penalty: Penalty | None, out: Params, leaves: Params, x: Tensor, y: Tensor
    ) -> Tensor:
        """``leaf.grad`` from a custom step direction (plus the penalty's gradient); untrained names the direction
        sets take their new values; returns the step's loss."""
        values = {n: t.detach() for n, t in out.items()}
        mask = torch.ones(x.shape[0], device=x.device)
        batchnorm = FunctionalBatchNorm(self.net) if has_batchnorm(self.net) else None
        with batchnorm if batchnorm is not None else nullcontext():
            if batchnorm is not None:
                batchnorm.begin(mask)
            self._batchnorm = batchnorm
            try:
                grads, loss, *rest = gradient(values, x, y, mask)
            finally:
                self._batchnorm = None
            if batchnorm is not None:  # the statistics the direction's forward passes computed
                out.update({n: v.detach() for n, v in batchnorm.updates(values).items()})
        if penalty is not None:
            extra = penalty_gradient(penalty, values, list(leaves))
            grads = {n: grads[n] + extra[n] if n in extra else grads[n] for n in leaves}
        for n, leaf in leaves.items():
            leaf.grad = grads[n].detach()
        for n, v in (rest[0] if rest else {}).items():
            out[n] = v.detach()
        return loss

    def full_gradient(self, params: Params, names: Sequence[str]) -> Params:
        """The gradient with respect to ``names`` of the client's mean loss on all of its training data (zeros for
        a client without data): one full-batch step's direction, as Per-FedAvg's evaluation-time adaptation takes."""
        if not self.num_samples:
            return {n: torch.zeros_like(params[n]) for n in names}
        leaves = {**params, **{n: params[n].detach().requires_grad_(True) for n in names}}
        grads = torch.autograd.grad(self.loss(leaves, self.x, self.y), [leaves[n] for n in names])
        return dict(zip(names, grads))

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


def add_gradient(leaves: Params, grads: Params) -> None:
    """``leaf.grad += grads[name]`` for the leaves ``grads`` names (a leaf without a gradient yet gets it)."""
    for n, g in grads.items():
        if n not in leaves:
            continue
        leaf = leaves[n]
        leaf.grad = g.detach().clone() if leaf.grad is None else leaf.grad + g.detach()


def penalty_gradient(penalty: Penalty, values: Params, names: Sequence[str], data: Params | None = None) -> Params:
    """The penalty's gradient for ``names`` at ``values``: its closed form, or ``torch.func.grad`` of ``fn``."""
    data = penalty.data if data is None else data
    if penalty.gradient is not None:
        return {n: g for n, g in penalty.gradient(values, data).items() if n in names}
    return torch.func.grad(lambda p: penalty.fn({**values, **p}, data))({n: values[n] for n in names})


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


def has_batchnorm(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def empty_class_sums(
    collect: tuple[int, int], device: torch.device, dtype: torch.dtype | None = None, clients: tuple[int, ...] = ()
) -> tuple[Tensor, Tensor]:
    """Zero (per-class sums ``[*clients, classes, width]``, per-class counts ``[*clients, classes]``)."""
    classes, width = collect
    return (
        torch.zeros(*clients, classes, width, device=device, dtype=dtype),
        torch.zeros(*clients, classes, device=device, dtype=dtype),
    )


def class_sum_step(sums: tuple[Tensor, Tensor], values: Tensor, y: Tensor, weight: Tensor | None = None) -> None:
    """Add ``values`` ``[B, D]`` (rows weighted by ``weight``, e.g. a padding mask) to ``sums`` = (per-class sums
    ``[C, D]``, per-class counts ``[C]``) by the rows' classes ``y``."""
    total, counts = sums
    values = values.detach().to(total.dtype)
    w = torch.ones(y.shape[0], dtype=total.dtype, device=total.device) if weight is None else weight.to(total.dtype)
    total.index_add_(0, y, values * w[:, None])
    counts.index_add_(0, y, w)


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


class FunctionalBatchNorm:
    """BatchNorm without in-place updates, for one client inside ``torch.func`` transforms (a ``Gradient``'s own
    ``torch.func.grad``; ``vmap`` over padded batches): in train mode the batch statistics are those of the real rows
    (``mask``), and the running statistics are returned instead of updated in place, exactly as
    ``torch.nn.functional.batch_norm`` updates them: ``r ← (1 − m)·r + m·batch`` with the unbiased variance
    (``n/(n − 1)``) for ``running_var``, m the momentum (``1/num_batches_tracked`` when None), and
    ``num_batches_tracked + 1``.

    Installed (``with``) on every BatchNorm module of ``net`` for a phase; ``begin(mask)`` before a client's forward
    passes, ``updates(params)`` after them: the new buffers of the BatchNorm layers that ran with the buffers of
    ``params`` (a forward with other parameters, such as MOON's global model, updates nothing). Several forward passes
    of one step chain their updates, as in-place updates do."""

    def __init__(self, net: nn.Module) -> None:
        #: the BatchNorm modules by the prefix of their buffers' names (``""`` for ``net`` itself)
        self.layers = {
            f"{name}." if name else "": m
            for name, m in net.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        }
        self.mask: Tensor | None = None
        self._new: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}

    def __enter__(self) -> FunctionalBatchNorm:
        for m in self.layers.values():
            m.forward = lambda x, m=m: self.forward(m, x)
        return self

    def __exit__(self, *exc: object) -> None:
        for m in self.layers.values():
            del m.forward
        self.mask, self._new = None, {}

    def begin(self, mask: Tensor | None) -> None:
        """A client's step starts: ``mask`` marks its batch's real rows; no statistics updated yet."""
        self.mask, self._new = mask, {}

    @contextmanager
    def rows(self, mask: Tensor) -> Iterator[None]:
        """Forward passes on another batch within the step (a ``Gradient``'s support and target batches): its real
        rows ``mask`` (one value per row)."""
        before, self.mask = self.mask, mask if mask.dim() == 1 else mask.reshape(mask.shape[0], -1)[:, 0]
        try:
            yield
        finally:
            self.mask = before

    def updates(self, params: Params) -> Params:
        out: Params = {}
        for prefix in self.layers:
            mean = params.get(f"{prefix}running_mean")
            if mean is None or id(mean) not in self._new:
                continue
            out[f"{prefix}running_mean"], out[f"{prefix}running_var"], count = map(_alive, self._new[id(mean)])
            if count is not None and f"{prefix}num_batches_tracked" in params:
                out[f"{prefix}num_batches_tracked"] = count
        return out

    def forward(self, m: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
        m._check_input_dim(x)
        mean_0, var_0 = m.running_mean, m.running_var
        if self.mask is None or not (m.training or mean_0 is None):  # eval mode: the running statistics
            return type(m).forward(m, x)
        mean_0, var_0, count_0 = map(_alive, self._new.get(id(mean_0), (mean_0, var_0, m.num_batches_tracked)))
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        rows = self.mask.to(x.dtype).view(-1, *[1] * (x.dim() - 1))
        n = self.mask.to(x.dtype).sum() * (x[0, 0].numel())
        mean = (x * rows).sum(dims) / n.clamp(min=1)
        centered = x - mean.view(shape)
        var = (centered * centered * rows).sum(dims) / n.clamp(min=1)
        out = centered * torch.rsqrt(var + m.eps).view(shape)
        if m.weight is not None:
            out = out * m.weight.view(shape) + m.bias.view(shape)
        if m.training and m.track_running_stats and mean_0 is not None:
            count = None if count_0 is None else count_0 + 1
            factor = m.momentum if m.momentum is not None else 1.0 / count.to(x.dtype)
            unbiased = var.detach() * n / (n - 1).clamp(min=1)
            self._new[id(m.running_mean)] = (
                (1 - factor) * mean_0 + factor * mean.detach(),
                (1 - factor) * var_0 + factor * unbiased,
                count,
            )
        return out


def _alive(t: Tensor | None) -> Tensor | None:
    """A statistic computed inside an autograd transform that has since returned (the step's ``grad_and_value``, or
    a ``Gradient``'s own ``torch.func.grad``), unwrapped to the level it is used at (it carries no gradient)."""
    return None if t is None else torch._C._functorch.unwrap_if_dead(t)
