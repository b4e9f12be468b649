"""The vectorized client executor: all sampled clients of a round in one pass, with the sequential loop's math.

``VectorizedContext`` presents ``K`` clients to an algorithm as one context whose parameters are stacked
``[K, ...]``. Algorithms written only with dict operations and ``ctx.sgd`` (FedAvg, FedPer, LG-FedAvg,
Local Only, FedRep, FedProx, …; ``Algorithm.vectorizable = True``) run unchanged on it.

Its ``sgd`` reproduces ``ClientContext.sgd`` exactly: each client shuffles with its own generator, walks its
own minibatches (padded and masked to the longest client), and takes steps of the client optimiser, written out
for stacked tensors (``BatchedSGD``, ``BatchedAdam``: the math of ``torch.optim.SGD``, ``Adam`` and ``AdamW``);
a client that has run out of batches (or of its straggler budget) is frozen by a mask, optimiser state
included. Other client optimisers run client by client with the ``torch.optim`` class itself (logged once).

Work that does not change the result is skipped:

* a phase that trains only the head, with no side branch and no augmentation, computes the frozen body's
  features once per client and round (one batched pass when all clients share the body) and trains the heads
  on them;
* steps are ``vmap``-ed over clients for heads and models without convolutions; convolutional phases run
  client by client with plain autograd in ``channels_last`` memory format (``vmap`` over per-client conv weights
  and ``torch.func.grad`` were both slower than that on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fl_lightning.local import (
    STEPS,
    ClientContext,
    ClientOptimizer,
    Params,
    Penalty,
    factory_name,
    select,
    state_name,
    step_limit,
)
from fl_lightning.stacked_mlp import loss_kind, stacked_forward, stacked_value_and_grad

FEATURE_CHUNK = 100  # the frozen-body feature pass is fastest in chunks of about 100 samples on CPU
log = logging.getLogger("fl_lightning")
_fallbacks_logged: set[str] = set()


def _per_client(mask: Tensor, like: Tensor) -> Tensor:
    """A ``[K]`` tensor shaped to broadcast against ``like`` ``[K, ...]``."""
    return mask.view(-1, *([1] * (like.dim() - 1)))


class BatchedSGD:
    """``torch.optim.SGD`` on stacked per-client tensors: ``d = g + λθ``; ``b = d`` on a state's first step, else
    ``b = μb + (1 − dampening)d``; ``θ ← θ − η(d + μb)`` with Nesterov, else ``θ ← θ − ηb``."""

    def __init__(self, hyper: dict) -> None:
        self.weight_decay, self.momentum, self.dampening = hyper["weight_decay"], hyper["momentum"], hyper["dampening"]
        self.nesterov, self.maximize = hyper["nesterov"], hyper["maximize"]
        self.keys = ("momentum_buffer",) if self.momentum else ()

    def init(self, p: Tensor) -> Params:
        return {"momentum_buffer": torch.zeros_like(p)} if self.momentum else {}

    def step(self, p: Tensor, g: Tensor, state: Params, count: Tensor, lr: float, wd: float) -> tuple[Tensor, Params]:
        d = -g if self.maximize else g
        if wd:
            d = d + wd * p
        if not self.momentum:
            return p - lr * d, {}
        if self.dampening:
            first = _per_client(count == 0, p)
            buf = torch.where(first, d, self.momentum * state["momentum_buffer"] + (1 - self.dampening) * d)
        else:  # a fresh buffer is zero, so μ·0 + d = d is torch's first step exactly
            buf = self.momentum * state["momentum_buffer"] + d
        d = d + self.momentum * buf if self.nesterov else buf
        return p - lr * d, {"momentum_buffer": buf}


class BatchedAdam:
    """``torch.optim.Adam`` / ``AdamW`` on stacked per-client tensors, each client with its own step count t:
    ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²`` (``v̂ = max`` of all v with amsgrad),
    ``θ ← θ − η/(1−β₁ᵗ) · m / (√v̂/√(1−β₂ᵗ) + ε)``; weight decay adds ``λθ`` to g (Adam) or multiplies θ by
    ``1 − ηλ`` first (AdamW)."""

    def __init__(self, hyper: dict, decoupled: bool) -> None:
        self.weight_decay, (self.beta1, self.beta2) = hyper["weight_decay"], (float(b) for b in hyper["betas"])
        self.eps, self.amsgrad, self.maximize = hyper["eps"], hyper["amsgrad"], hyper["maximize"]
        self.decoupled = decoupled
        self.keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def init(self, p: Tensor) -> Params:
        state = {"step": torch.zeros(p.shape[0], device=p.device)}
        state.update({k: torch.zeros_like(p) for k in self.keys[1:]})
        return state

    def step(self, p: Tensor, g: Tensor, state: Params, count: Tensor, lr: float, wd: float) -> tuple[Tensor, Params]:
        g = -g if self.maximize else g
        step = state["step"] + 1
        if wd and self.decoupled:
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        new = {"step": step, "exp_avg": torch.lerp(state["exp_avg"], g, 1 - self.beta1)}
        new["exp_avg_sq"] = state["exp_avg_sq"] * self.beta2 + (1 - self.beta2) * g * g
        second = new["exp_avg_sq"]
        if self.amsgrad:
            second = new["max_exp_avg_sq"] = torch.maximum(state["max_exp_avg_sq"], new["exp_avg_sq"])
        t = _per_client(step.double(), p)
        step_size = (lr / (1 - self.beta1**t)).to(p.dtype)
        bias2_sqrt = ((1 - self.beta2**t) ** 0.5).to(p.dtype)
        return p - step_size * (new["exp_avg"] / (second.sqrt() / bias2_sqrt + self.eps)), new


BatchedRule = BatchedSGD | BatchedAdam


def batched_rule(settings: ClientOptimizer) -> BatchedRule | None:
    """The stacked-tensor version of the client optimiser, or None when there is none."""
    probe = settings.probe()
    hyper = probe.defaults
    if hyper.get("differentiable") or isinstance(hyper.get("lr"), Tensor):
        return None
    if type(probe) is torch.optim.SGD:
        return BatchedSGD(hyper)
    if type(probe) in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = type(probe) is torch.optim.AdamW or bool(hyper.get("decoupled_weight_decay", False))
        return BatchedAdam(hyper, decoupled)
    return None


def per_sample_loss_for(num_classes: int | None) -> Callable[[Tensor, Tensor], Tensor]:
    if num_classes is None:
        return lambda out, y: 0.5 * (out - y) ** 2
    return lambda out, y: F.cross_entropy(out, y, reduction="none")


def has_conv(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in net.modules())


def has_batchnorm(net: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def stack(dicts: Sequence[Params]) -> Params:
    return {n: torch.stack([d[n] for d in dicts]) for n in dicts[0]} if dicts else {}


def unstack(stacked: Params, k: int) -> Params:
    return {n: v[k] for n, v in stacked.items()}


class VectorizedContext:
    """``K`` clients' data, RNGs and local optimiser; parameters are stacked ``[K, ...]``."""

    def __init__(
        self,
        net: nn.Module,
        clients: Sequence[int],
        xs: Sequence[Tensor],
        ys: Sequence[Tensor],
        sides: Sequence[Tensor] | None,
        optimizer: ClientOptimizer,
        per_sample_loss: Callable[[Tensor, Tensor], Tensor],
        generators: Sequence[torch.Generator],
        augment: Callable[[Tensor, torch.Generator], Tensor] | None,
        round_idx: int,
        seed: int,
        step_budgets: Sequence[float],
        cache_features: bool = True,
        loop_over_clients: bool | None = None,
    ) -> None:
        self.net, self.clients, self.xs, self.ys, self.sides = net, list(clients), list(xs), list(ys), sides
        self.optimizer, self.per_sample_loss, self.generators = optimizer, per_sample_loss, list(generators)
        self.augment, self.round, self.seed, self.step_budgets = augment, round_idx, seed, list(step_budgets)
        self.cache_features = cache_features
        self.loop_over_clients = has_conv(net) if loop_over_clients is None else loop_over_clients
        self.param_names = [n for n, p in net.named_parameters() if p.requires_grad]  # frozen ones never train
        device = xs[0].device if xs else torch.device("cpu")
        self.sizes = torch.tensor([x.shape[0] for x in xs], device=device)
        self.train_loss: Tensor = torch.zeros(len(xs), device=device)
        self.feature_passes = 0  # how many times a frozen body computed features (for tests and the benchmark)
        #: the clients' kept optimiser state stacked ``[K, ...]`` (``local.state_template`` names), or None: fresh
        self.optimizer_state: Params | None = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_samples(self) -> Tensor:
        return self.sizes

    def params_with(self, prefixes: Sequence[str]) -> list[str]:
        return select(self.param_names, prefixes)

    def params_without(self, prefixes: Sequence[str]) -> list[str]:
        chosen = set(select(self.param_names, prefixes))
        return [n for n in self.param_names if n not in chosen]

    # ---- minibatches ----------------------------------------------------------------------------------------
    def _epoch_batches(
        self, inputs: Sequence[Tensor], remaining: Sequence[int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One epoch for every client, padded: ``x [K, B, bs, ...]``, ``y``, ``mask [K, B, bs]``, ``active [K, B]``.

        Each client draws its permutation (and augmentations) from its own generator exactly as the sequential
        loop does: a client with no steps ``remaining`` draws nothing, and batches past its budget are not made.
        """
        bs = self.optimizer.batch_size
        num_batches = [min(-(-x.shape[0] // bs), r) for x, r in zip(inputs, remaining)]
        b_max = max(num_batches)
        x_out = inputs[0].new_zeros(self.num_clients, b_max, bs, *inputs[0].shape[1:])
        y_out = self.ys[0].new_zeros(self.num_clients, b_max, bs)
        mask = torch.zeros(self.num_clients, b_max, bs, device=inputs[0].device)
        for k, (x, g) in enumerate(zip(inputs, self.generators)):
            if num_batches[k] <= 0:
                continue
            perm = torch.randperm(x.shape[0], generator=g).to(x.device)
            for b in range(num_batches[k]):
                idx = perm[b * bs : (b + 1) * bs]
                xb = x[idx]
                if self.augment is not None and inputs is self.xs:
                    xb = self.augment(xb, g)
                x_out[k, b, : len(idx)] = xb
                y_out[k, b, : len(idx)] = self.ys[k][idx]
                mask[k, b, : len(idx)] = 1.0
        active = (
            torch.arange(b_max, device=mask.device)[None, :] < torch.tensor(num_batches, device=mask.device)[:, None]
        )
        return x_out, y_out, mask, active

    # ---- features of a frozen body --------------------------------------------------------------------------
    def _head_only(self, trainable: Sequence[str]) -> bool:
        return (
            self.cache_features
            and self.augment is None
            and getattr(self.net, "side", None) is None
            and hasattr(self.net, "body")
            and hasattr(self.net, "head")
            and all(n.startswith("head.") for n in trainable)
        )

    @torch.no_grad()
    def _features(self, params: Params) -> list[Tensor]:
        """φ(x) for every client with its (frozen) body; one pass over all data when the body is shared."""
        self.feature_passes += 1
        body = {n[len("body.") :]: v for n, v in params.items() if n.startswith("body.")}
        shared = all(v.stride(0) == 0 or torch.equal(v[0].expand_as(v), v) for v in body.values())
        if shared:
            one = {n: v[0] for n, v in body.items()}
            data = torch.cat(self.xs)
            if data.dim() == 4:
                data = data.contiguous(memory_format=torch.channels_last)
            feats = torch.cat([functional_call(self.net.body, one, (c,)) for c in data.split(FEATURE_CHUNK)])
            return list(feats.split(self.sizes.tolist()))
        return [
            functional_call(self.net.body, unstack(body, k), (x,)) if x.shape[0] else x.new_zeros(0)
            for k, x in enumerate(self.xs)
        ]

    # ---- SGD --------------------------------------------------------------------------------------------------
    def sgd(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: Penalty | None = None,
        lr: float | None = None,
        max_steps: int | None = None,
    ) -> Params:
        """``ClientContext.sgd`` for every client at once (same batches, same steps, same result)."""
        out = {n: t.detach().clone() for n, t in params.items()}
        if not trainable or epochs <= 0 or self.num_clients == 0:
            return out
        lr = self.optimizer.lr if lr is None else lr
        rule = batched_rule(self.optimizer)
        trainable = list(trainable)
        if rule is None:
            name = factory_name(self.optimizer.factory)
            if name not in _fallbacks_logged:
                _fallbacks_logged.add(name)
                log.warning("vectorized executor: client optimizer %s has no batched form: clients run in turn", name)
            return self._sgd_client_by_client(out, trainable, epochs, penalty, lr, max_steps)
        wd, bs = rule.weight_decay, self.optimizer.batch_size
        if self._head_only(trainable):
            inputs, module = self._features(out), self.net.head
            names = {n: n[len("head.") :] for n in out if n.startswith("head.")}
        elif self.loop_over_clients:
            return self._sgd_client_by_client(out, trainable, epochs, penalty, lr, max_steps)
        else:
            inputs, module = self.xs, self.net
            names = {n: n for n in out}
        limits = [
            step_limit(budget, epochs, int(n), bs, max_steps) or 1 << 62
            for budget, n in zip(self.step_budgets, self.sizes)
        ]
        limits_t = torch.tensor(limits, device=self.sizes.device)

        train = {n: out[n] for n in trainable}
        frozen = {n: out[n] for n in out if n not in train}
        kept = self.optimizer_state
        if kept is None:  # a fresh optimiser for this phase
            state = {n: rule.init(v) for n, v in train.items()}
            count = {n: torch.zeros(self.num_clients, dtype=torch.long, device=v.device) for n, v in train.items()}
        else:  # each client continues from its own kept state
            state = {n: {k: kept[state_name(k, n)] for k in rule.keys} for n in train}
            count = {n: kept[state_name(STEPS, n)].clone() for n in train}
        steps = torch.zeros(self.num_clients, dtype=torch.long, device=self.sizes.device)
        loss_sum = torch.zeros(self.num_clients, device=self.sizes.device)

        def client_loss(p: Params, fz: Params, x: Tensor, y: Tensor, m: Tensor) -> Tensor:
            local = {names[n]: v for n, v in {**fz, **p}.items() if n in names}
            loss = (self.per_sample_loss(functional_call(module, local, (x,)), y) * m).sum() / m.sum()
            if penalty is not None:
                loss = loss + penalty({**fz, **p})
            return loss

        value_and_grad = torch.func.grad_and_value(client_loss)
        fast = stacked_forward(module) if penalty is None else None  # batched matmuls instead of vmap (stacked_mlp)
        kind = loss_kind(self.per_sample_loss) if fast is not None else None
        for _ in range(epochs):
            remaining = (limits_t - steps).clamp(min=0).tolist()
            if max(remaining) <= 0:
                break
            xb_all, yb_all, mask_all, active_all = self._epoch_batches(inputs, remaining)
            for b in range(xb_all.shape[1]):
                active = active_all[:, b] & (steps < limits_t)
                if not bool(active.any()):
                    continue
                safe_mask = mask_all[:, b].clone()
                safe_mask[~active, 0] = 1.0  # inactive clients compute a throwaway loss (masked below)
                step = None if fast is None else stacked_value_and_grad(
                    fast, self.per_sample_loss, names, train, frozen, xb_all[:, b], yb_all[:, b], safe_mask, kind
                )
                if step is None:
                    fast, step = None, vmap(value_and_grad)(train, frozen, xb_all[:, b], yb_all[:, b], safe_mask)
                grads, losses = step
                for n, g in grads.items():
                    decay = wd if self.optimizer.decay_bias or not n.endswith("bias") else 0.0
                    new_p, new_state = rule.step(train[n], g, state[n], count[n], lr, decay)
                    train[n] = torch.where(_per_client(active, g), new_p, train[n])
                    state[n] = {k: torch.where(_per_client(active, v), v, state[n][k]) for k, v in new_state.items()}
                    count[n] = count[n] + active.long()
                loss_sum += torch.where(active, losses.detach(), torch.zeros_like(losses))
                steps += active.long()
        self.train_loss = loss_sum / steps.clamp(min=1)
        if kept is not None:
            self.optimizer_state = dict(kept)
            for n in train:
                self.optimizer_state[state_name(STEPS, n)] = count[n]
                for k, v in state[n].items():
                    self.optimizer_state[state_name(k, n)] = v
        out.update(train)
        return {n: v.detach() for n, v in out.items()}

    def _sgd_client_by_client(
        self,
        params: Params,
        trainable: Sequence[str],
        epochs: int,
        penalty: Penalty | None,
        lr: float | None,
        max_steps: int | None,
    ) -> Params:
        """Conv phases (and client optimisers without a batched version): each client in turn with plain autograd
        in ``channels_last`` (faster than batching per-client conv weights on CPU); same generators, so the same
        batches as the sequential loop."""
        results, losses, kept = [], [], []
        for k, client in enumerate(self.clients):
            ctx = ClientContext(
                self.net,
                client,
                self.xs[k],
                self.ys[k],
                None if self.sides is None else self.sides[k],
                self.optimizer,
                lambda out, y: self.per_sample_loss(out, y).mean(),
                self.generators[k],
                self.augment,
                self.round,
                self.seed,
                self.step_budgets[k],
                channels_last=True,
            )
            ctx.optimizer_state = None if self.optimizer_state is None else unstack(self.optimizer_state, k)
            results.append(ctx.sgd(unstack(params, k), trainable, epochs, penalty, lr, max_steps))
            losses.append(ctx.train_loss)
            kept.append(ctx.optimizer_state)
        self.train_loss = torch.tensor(losses, device=self.sizes.device)
        if self.optimizer_state is not None:
            self.optimizer_state = stack(kept)
        return {n: v.contiguous() for n, v in stack(results).items()}
