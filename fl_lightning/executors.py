"""The vectorized client executor: all sampled clients of a round in one pass, with the sequential loop's math.

``VectorizedContext`` presents ``K`` clients to an algorithm as one context whose parameters are stacked
``[K, ...]``. Algorithms written only with dict operations and ``ctx.sgd`` (FedAvg, FedPer, LG-FedAvg,
Local Only, FedRep, FedProx, …; ``Algorithm.vectorizable = True``) run unchanged on it.

Its ``sgd`` reproduces ``ClientContext.sgd`` exactly: each client shuffles with its own generator, walks its
own minibatches (padded and masked to the longest client), and takes momentum-SGD steps; a client that has
run out of batches (or of its straggler budget) is frozen by a mask, momentum buffer included.

Work that does not change the result is skipped:

* a phase that trains only the head, with no side branch and no augmentation, computes the frozen body's
  features once per client and round (one batched pass when all clients share the body) and trains the heads
  on them;
* steps are ``vmap``-ed over clients for heads and models without convolutions; convolutional phases run
  client by client with plain autograd in ``channels_last`` memory format (``vmap`` over per-client conv weights
  and ``torch.func.grad`` were both slower than that on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fl_lightning.local import ClientContext, ClientOptimizer, Params, Penalty, select, step_limit

FEATURE_CHUNK = 100  # the frozen-body feature pass is fastest in chunks of about 100 samples on CPU


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
        momentum, wd, bs = self.optimizer.momentum, self.optimizer.weight_decay, self.optimizer.batch_size
        trainable = list(trainable)
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
        buf = {n: torch.zeros_like(v) for n, v in train.items()}
        steps = torch.zeros(self.num_clients, dtype=torch.long, device=self.sizes.device)
        loss_sum = torch.zeros(self.num_clients, device=self.sizes.device)

        def client_loss(p: Params, fz: Params, x: Tensor, y: Tensor, m: Tensor) -> Tensor:
            local = {names[n]: v for n, v in {**fz, **p}.items() if n in names}
            loss = (self.per_sample_loss(functional_call(module, local, (x,)), y) * m).sum() / m.sum()
            if penalty is not None:
                loss = loss + penalty({**fz, **p})
            return loss

        value_and_grad = torch.func.grad_and_value(client_loss)
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
                grads, losses = vmap(value_and_grad)(train, frozen, xb_all[:, b], yb_all[:, b], safe_mask)
                for n, g in grads.items():
                    a = active.view(-1, *([1] * (g.dim() - 1)))
                    if wd and (self.optimizer.decay_bias or not n.endswith("bias")):
                        g = g + wd * train[n]
                    buf[n] = torch.where(a, momentum * buf[n] + g, buf[n])
                    train[n] = torch.where(a, train[n] - lr * buf[n], train[n])
                loss_sum += torch.where(active, losses.detach(), torch.zeros_like(losses))
                steps += active.long()
        self.train_loss = loss_sum / steps.clamp(min=1)
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
        """Conv phases: each client in turn with plain autograd in ``channels_last`` (faster than batching
        per-client conv weights on CPU); same generators, so the same batches as the sequential loop."""
        results, losses = [], []
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
            results.append(ctx.sgd(unstack(params, k), trainable, epochs, penalty, lr, max_steps))
            losses.append(ctx.train_loss)
        self.train_loss = torch.tensor(losses, device=self.sizes.device)
        return {n: v.contiguous() for n, v in stack(results).items()}
