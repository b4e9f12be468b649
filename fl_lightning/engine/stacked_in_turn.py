"""The stacked path's client-by-client sub-paths (``StackedPaths``: ``conv in turn`` and ``in turn``): the cohort's
clients one after another, with the loop's numbers.

``ClientsInTurn`` is the part of ``VectorizedContext`` that runs them (a base class of it: the context's own state
is read and written, as its batched steps do):

* ``_sgd_in_turn`` (``conv in turn``: convolutional phases on the CPU): each client with plain autograd on the
  phase plan's batches (the same draws as the batched path), the client optimiser as ``torch.optim`` builds it (the
  default SGD fused), weights and batches in ``channels_last``, ``sequential_forward`` (or the phase's
  ``Objective``), without a context or a batch generator per client;
* ``_sgd_client_by_client`` (``in turn``, and ``conv in turn`` phases with a custom step direction, side data or
  kept optimiser state): each client with the sequential ``ClientContext.sgd`` on its own generator (the same
  batches), conv inputs in ``channels_last``, no reads from the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from fl_lightning.client import ClientOptimizer, Objective, Params, Penalty
from fl_lightning.engine.phases import Phase, PhasePlan
from fl_lightning.engine.sequential import ClientContext, FunctionalBatchNorm, class_sum_step, empty_class_sums
from fl_lightning.engine.stacked_nets import channels_last, sequential_forward, stack, unstack


class ClientsInTurn:
    """The cohort's clients in turn; what it reads and sets of the ``VectorizedContext`` it is part of is annotated
    here."""

    net: nn.Module
    clients: list[int]
    xs: list[Tensor]
    ys: list[Tensor]
    sides: Tensor | None
    optimizer: ClientOptimizer
    generators: list[torch.Generator]
    augment: Any
    round: int
    seed: int
    step_budgets: list[float]
    device: torch.device
    buffer_names: frozenset[str]
    train_loss: Tensor
    steps_taken: Tensor
    optimizer_state: Params | None
    class_sums_seen: tuple[Tensor, Tensor] | None
    _side: Tensor | None
    _batchnorm: FunctionalBatchNorm | None

    num_clients: int
    data: tuple[Tensor, Tensor]
    per_sample_loss: Callable[[Tensor, Tensor], Tensor]
    _plan: Callable[..., PhasePlan]

    def _sgd_in_turn(self, out: Params, phase: Phase) -> Params:
        """Client by client with plain autograd (``CONV_CLIENTS``: the CPU's convolutional phases):
        ``ClientContext.sgd`` on the phase plan's batches (the same draws), the client optimiser as ``torch.optim``
        builds it (the default SGD fused), weights and batches in ``channels_last``, ``sequential_forward`` (or the
        phase's ``Objective``), without a context or a batch generator per client. Each client's buffers are its
        own copies (BatchNorm updates them in place, as in the loop)."""
        plan = self._plan(phase.epochs, phase.bs, phase.min_batch, phase.max_steps)
        data_x, data_y = self.data
        trainable, penalty, objective = phase.trainable, phase.penalty, phase.objective
        buffers = [n for n in out if n not in trainable and n in self.buffer_names]
        trained: dict[str, list[Tensor]] = {n: [] for n in [*trainable, *buffers]}
        losses, collected = [], []
        for k in range(self.num_clients):
            params = {n: channels_last(v[k]) for n, v in out.items()}
            params.update({n: out[n][k].clone() for n in buffers})
            leaves = {n: channels_last(out[n][k].clone()).requires_grad_(True) for n in trainable}
            params.update(leaves)
            opt = self.optimizer.build(leaves, phase.lr, fused=self.device.type == "cpu")
            pdata = None if penalty is None else unstack(penalty.data, k)
            odata = None if objective is None else unstack(objective.data, k)
            loss_sum = torch.zeros((), device=self.device)
            seen = None
            for s, length in enumerate(plan.lengths[k]):
                rows = plan.rows[s, k, :length]
                x = data_x[rows]
                if plan.draws is not None:
                    x = self.augment.apply(x, plan.draws[s, k, :length])
                opt.zero_grad(set_to_none=True)
                logged = None
                if objective is None:
                    loss = self.per_sample_loss(sequential_forward(self.net, params, channels_last(x)), data_y[rows])
                    loss = loss.mean()
                else:
                    per, per_logged, *values = objective.losses(params, channels_last(x), data_y[rows], odata)
                    loss, logged = per.mean(), None if per_logged is per else per_logged.mean()
                    if objective.collect is not None and s >= plan.host_last_epoch[k]:
                        if seen is None:
                            seen = empty_class_sums(objective.collect, self.device, values[0].dtype)
                        class_sum_step(seen, values[0], data_y[rows])
                loss = ClientContext._backward(loss, None if penalty is None else Penalty(
                    penalty.fn, pdata, penalty.gradient), params, leaves)  # fmt: skip
                opt.step()
                loss_sum = loss_sum + (loss if logged is None else logged).detach()
            losses.append(loss_sum / max(plan.host_steps[k], 1))
            if seen is not None:
                collected.append(seen)
            for n in trained:
                trained[n].append((leaves if n in leaves else params)[n].detach())
        self.train_loss = torch.stack(losses)
        self.steps_taken = plan.steps
        if objective is not None and objective.collect is not None:
            empty = empty_class_sums(objective.collect, self.device)
            seen_k = iter(collected)
            rows = [next(seen_k) if plan.host_steps[k] else empty for k in range(self.num_clients)]
            self.class_sums_seen = (torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]))
        out.update({n: torch.stack(v).contiguous() for n, v in trained.items()})
        return out

    def _sgd_client_by_client(self, params: Params, phase: Phase) -> Params:
        """Each client in turn with ``ClientContext.sgd`` (the reference, on the same generators: the same
        batches), conv inputs in ``channels_last``; no reads from the device. The phase's functions, written against
        this context, see each client's side vector."""
        results, losses, steps, kept, seen = [], [], [], [], []
        penalty, objective, gradient = phase.penalty, phase.objective, phase.gradient
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
            mine = None if penalty is None else Penalty(penalty.fn, unstack(penalty.data, k), penalty.gradient)
            own = None
            if objective is not None:
                own = Objective(self._as_client(objective.fn, ctx), unstack(objective.data, k), objective.collect)
            self._side = ctx.side  # for functions called outside the phase's steps
            results.append(
                ctx.sgd(
                    unstack(params, k), phase.trainable, phase.epochs, mine, phase.lr, phase.max_steps,
                    gradient=None if gradient is None else self._as_client(gradient, ctx),
                    batch_size=phase.bs, min_batch=phase.min_batch, objective=own,
                )
            )  # fmt: skip
            self._side = None
            losses.append(torch.as_tensor(ctx.train_loss, device=self.device))
            steps.append(ctx.steps_taken)
            kept.append(ctx.optimizer_state)
            seen.append(ctx.class_sums_seen)
        self.train_loss = torch.stack(losses).to(self.device)
        self.steps_taken = torch.stack(steps).to(self.device)
        if self.optimizer_state is not None:
            self.optimizer_state = stack(kept)
        if objective is not None and objective.collect is not None:
            self.class_sums_seen = (torch.stack([t[0] for t in seen]), torch.stack([t[1] for t in seen]))
        return {n: v.contiguous() for n, v in stack(results).items()}

    def _as_client(self, fn: Callable, ctx: ClientContext) -> Callable:
        """A function written against this context (``self.batch_loss``, ``self.side_for``) run for one client's
        context: this context's side vector and BatchNorm handling are that client's while it runs."""

        def one(*args: object) -> object:
            self._side, self._batchnorm = ctx.side, ctx._batchnorm  # BatchNorm as that context runs it
            try:
                return fn(*args)
            finally:
                self._side, self._batchnorm = None, None

        return one
