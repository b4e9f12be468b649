"""The vectorized client executor: all sampled clients of a round in one pass, with the sequential loop's math.

``VectorizedContext`` presents ``K`` clients to an algorithm as one context whose parameters are stacked
``[K, ...]``: it implements the client contract ``fl_lightning.client.Client``, as ``ClientContext`` does for one
client. Algorithms written only against it and dict operations (``Algorithm.vectorizable = True``: FedAvg, FedPer,
LG-FedAvg, Local Only, FedRep, FedBABU, FedProx, Ditto, SCAFFOLD, APFL, L2GD, Fed-MTL, Per-FedAvg, FedBN, MOON,
FedProto, FedDyn, pFedMe, FedRoD) run unchanged on it. Per-client constants of a loss term travel in the data of a
``Penalty`` (whose gradient may be given in closed form: no autograd pass through a proximal term) or of an
``Objective`` (a per-sample minibatch loss written for one client: MOON's contrastive term, FedProto's prototype
distance, FedRoD's two heads), custom step directions (Per-FedAvg's meta-gradient, APFL's two models, pFedMe's
personal solve, which carries θ̃ from step to step) as a ``Gradient``; all of them are ``vmap``-ed over clients.
BatchNorm layers keep each client's running statistics ``[K, ...]``: in a ``vmap``-ed step ``FunctionalBatchNorm``
normalises with the batch statistics of the client's real rows and returns the statistics torch would have written.

Its ``sgd`` reproduces ``ClientContext.sgd``: each client draws its epochs from its own generator exactly as the
sequential loop does (``epoch_draws``), walks its own minibatches (padded and masked; step ``s`` of every client
runs together), and takes steps of the client optimiser, written out for stacked tensors (``BatchedSGD``,
``BatchedAdam``: the math of ``torch.optim.SGD``, ``Adam`` and ``AdamW``); a client that has run out of steps
(or of its straggler budget) is frozen by a mask, optimiser state included.

No host syncs inside a phase: the draws of all its epochs are made on the CPU generators before the first step and
moved to the device in ONE copy (``PhasePlan``); which client steps when is known on the host; losses are summed
on the device. How the steps are computed is the run's ``StackedPaths`` (``fl_lightning.engine.stacked_paths``,
decided once by ``executor.decide`` and named in the run's executor line), read by ``sgd``:

* a phase that trains only the head on a frozen body (``StackedPaths.head``) runs the body on the phase's batches in
  a few large no-grad passes: once per client and round without augmentation, or per block of steps on the
  augmented batches (in plan order, augmented chunk by chunk), as ONE batch for the whole cohort when the clients
  share the body (FedRep's head phase, "+FT") — then trains the heads on those features. ``sequential_forward``
  runs an ``nn.Sequential`` body with each ``ReLU`` that precedes a max-pool after it, in place (the same values);
* ``fused relu mlp`` and ``batched matmul``: networks made of ``Linear`` layers and elementwise activations step
  with batched matrix products (``stacked_forward``) and ordinary autograd, or a ReLU network's gradient by hand;
* ``vmap``: other networks are ``vmap``-ed over clients (``torch.func``), convolutions included on accelerators
  (functorch turns a convolution with per-client weights into one grouped convolution);
* ``conv in turn`` and ``in turn``: the clients one after another (``fl_lightning.engine.stacked_in_turn``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, vmap
from torch.nn import functional as F

from fl_lightning.client import (
    ClientOptimizer,
    Gradient,
    MaxSteps,
    Objective,
    Params,
    Penalty,
    PenaltyLike,
    select,
)
from fl_lightning.engine.batched_optim import BatchedRule, batched_rule, per_row
from fl_lightning.engine.compiled import compiled_step
from fl_lightning.engine.notes import say_once
from fl_lightning.engine.phases import Phase, PhasePlan, masked_mean, plan_phase
from fl_lightning.engine.sequential import (
    FunctionalBatchNorm,
    draws_ahead,
    empty_class_sums,
    has_batchnorm,
    penalty_gradient,
)
from fl_lightning.engine.stacked_in_turn import ClientsInTurn
from fl_lightning.engine.stacked_nets import (
    Layer,
    channels_last,
    own_stacked_forward,
    pad_rows,
    per_sample_cross_entropy,
    relu_layers,
    relu_net_gradient,
    sequential_forward,
    stacked_forward,
    unstack,
)
from fl_lightning.engine.stacked_paths import (
    CONV_CLIENTS,
    SgdPath,
    StackedPaths,
    conv_clients,
    conv_in_turn,
    plan_stacked,
)
from fl_lightning.engine.state import STEPS, state_name

__all__ = ["CONV_CLIENTS", "FEATURE_CHUNK", "VectorizedContext", "conv_clients", "feature_chunk"]

FEATURE_CHUNK = 100  # the frozen-body feature pass is fastest in chunks of about 100 samples on CPU


def feature_chunk(device: torch.device) -> int:
    """Samples per no-grad body pass: about 100 on the CPU (fastest there), large batches on accelerators."""
    return FEATURE_CHUNK if device.type == "cpu" else 8192


class VectorizedContext(ClientsInTurn):
    """``K`` clients' data, RNGs and local optimiser; parameters are stacked ``[K, ...]``. ``paths``: the run's
    sub-paths (``executor.decide``); without them the context plans its own at its first phase
    (``cache_features``, ``loop_over_clients``: the plan's inputs, which a test or benchmark may set before)."""

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
        paths: StackedPaths | None = None,
    ) -> None:
        self.net, self.clients, self.xs, self.ys = net, list(clients), list(xs), list(ys)
        self.sides = None if sides is None else torch.stack(list(sides))
        self.optimizer, self._per_sample, self.generators = optimizer, per_sample_loss, list(generators)
        self.augment, self.round, self.seed, self.step_budgets = augment, round_idx, seed, list(step_budgets)
        self.cache_features = cache_features
        self.device = xs[0].device if xs else torch.device("cpu")
        self.loop_over_clients = conv_in_turn(net, self.device) if loop_over_clients is None else loop_over_clients
        self.paths = paths
        self.param_names = [n for n, p in net.named_parameters() if p.requires_grad]  # frozen ones never train
        self.buffer_names = frozenset(n for n, _ in net.named_buffers())
        self.sizes = [x.shape[0] for x in xs]  # on the host: nothing is read back from the device
        self.offsets = [sum(self.sizes[:k]) for k in range(len(self.sizes))]
        self.train_loss: Tensor = torch.zeros(len(xs), device=self.device)
        #: the minibatch steps each client took in the last phase (``[K]``, on the device)
        self.steps_taken: Tensor = torch.zeros(len(xs), dtype=torch.long, device=self.device)
        self.feature_passes = 0  # how many times a frozen body computed features (for tests and the benchmark)
        #: the clients' kept optimiser state stacked ``[K, ...]`` (``local.state_template`` names), or None: fresh
        self.optimizer_state: Params | None = None
        #: (per-class sums ``[K, C, D]``, counts ``[K, C]``) of the last phase's ``Objective.collect``, or None
        self.class_sums_seen: tuple[Tensor, Tensor] | None = None
        self._data: tuple[Tensor, Tensor] | None = None
        self._side: Tensor | None = None  # the client's side vector inside a vmapped step (``batch_loss``)
        self._batchnorm: FunctionalBatchNorm | None = None  # per-client BatchNorm statistics in a vmapped phase

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    @property
    def num_samples(self) -> list[int]:
        return self.sizes

    @property
    def step_budget(self) -> list[float]:
        """Each client's straggler budget."""
        return self.step_budgets

    def params_with(self, prefixes: Sequence[str]) -> list[str]:
        return select(self.param_names, prefixes)

    def params_without(self, prefixes: Sequence[str]) -> list[str]:
        chosen = set(select(self.param_names, prefixes))
        return [n for n in self.param_names if n not in chosen]

    @property
    def data(self) -> tuple[Tensor, Tensor]:
        """All K clients' training rows, client after client (row ``offsets[k] + i`` is client k's sample i)."""
        if self._data is None:
            self._data = (torch.cat(self.xs), torch.cat(self.ys))
        return self._data

    # ---- losses ------------------------------------------------------------------------------------------------
    def _masked_loss(
        self, module: nn.Module, names: dict[str, str], params: Params, x: Tensor, y: Tensor, mask: Tensor
    ) -> Tensor:
        """One client's mean loss over the real rows of a padded batch (inside ``vmap``)."""
        local = {names[n]: v for n, v in params.items() if n in names}
        kwargs = {}
        if module is self.net and self._side is not None:
            kwargs["side"] = self._side.expand(x.shape[0], *self._side.shape)
        with self._batchnorm.rows(mask) if self._batchnorm is not None else nullcontext():
            out = functional_call(module, local, (x,), kwargs, strict=False)
        return (self.per_sample_loss(out, y) * mask).sum() / mask.sum().clamp(min=1)

    def batch_loss(self, params: Params, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """One client's minibatch loss for a ``Gradient`` function (called inside ``vmap``)."""
        mask = torch.ones_like(y, dtype=x.dtype) if mask is None else mask
        return self._masked_loss(self.net, {n: n for n in params}, params, x, y, mask)

    def side_for(self, n: int) -> Tensor | None:
        """The side vector of the client being computed (inside ``sgd``'s functions) for ``n`` samples."""
        return None if self._side is None else self._side.expand(n, *self._side.shape)

    def forward(self, params: Params, x: Tensor) -> Tensor:
        """One client's outputs (inside ``sgd``'s functions, where ``params`` are that client's)."""
        return functional_call(self.net, params, (x,), {"side": self.side_for(x.shape[0])}, strict=False)

    def loss(self, params: Params, x: Tensor, y: Tensor) -> Tensor:
        """One client's mean loss on ``(x, y)`` (inside ``sgd``'s functions)."""
        return self.per_sample_loss(self.forward(params, x), y).mean()

    def per_sample_loss(self, out: Tensor, y: Tensor) -> Tensor:
        return self._per_sample(out, y)

    def label_counts(self, num_classes: int) -> Tensor:
        """Each client's training samples per class ``[K, C]``."""
        if not self.ys:
            return torch.zeros(0, num_classes, dtype=torch.long, device=self.device)
        return torch.stack([torch.bincount(y, minlength=num_classes) for y in self.ys])

    @torch.no_grad()
    def mean_loss(self, params: Params) -> Tensor:
        """Each client's loss on all of its training data with its own ``params`` (``[K]``)."""
        out = []
        for k, (x, y) in enumerate(zip(self.xs, self.ys)):
            mine = unstack(params, k)
            self._side = None if self.sides is None else self.sides[k]
            if x.shape[0] == 0:
                out.append(torch.zeros((), device=self.device))
                continue
            out.append(self._masked_loss(self.net, {n: n for n in mine}, mine, x, y, torch.ones_like(y, dtype=x.dtype)))
        self._side = None
        return torch.stack(out) if out else torch.zeros(0, device=self.device)

    def full_gradient(self, params: Params, names: Sequence[str]) -> Params:
        """Each client's gradient of its mean loss on all of its training data with its own ``params``, ``[K, ...]``
        (``ClientContext.full_gradient``): ``vmap`` over the clients' zero-padded rows, the padding masked out."""
        names = list(names)
        sizes = [x.shape[0] for x in self.xs]
        if not names or not any(sizes):
            return {n: torch.zeros_like(params[n]) for n in names}
        x, y = pad_rows(self.xs), pad_rows(self.ys)
        mask = (torch.arange(x.shape[1], device=x.device) < torch.tensor(sizes, device=x.device)[:, None]).to(x.dtype)
        trained = {n: params[n] for n in names}
        frozen = {n: v for n, v in params.items() if n not in trained}
        everything = {n: n for n in params}

        def one_client(p: Params, fz: Params, xb: Tensor, yb: Tensor, mb: Tensor, side: Tensor | None) -> Tensor:
            self._side = side
            return self._masked_loss(self.net, everything, {**fz, **p}, xb, yb, mb)

        try:
            grads = vmap(grad(one_client), in_dims=(0, 0, 0, 0, 0, None if self.sides is None else 0))(
                trained, frozen, x, y, mask, self.sides
            )
        finally:
            self._side = None
        return dict(grads)

    # ---- features of a frozen body --------------------------------------------------------------------------
    @staticmethod
    def _body_of(params: Params) -> tuple[Params, bool]:
        """The body's parameters (names without ``body.``) and whether all clients share them (stride-0 views
        of one tensor, as the engine passes the global model: detected without reading the device)."""
        body = {n[len("body.") :]: v for n, v in params.items() if n.startswith("body.")}
        return body, all(v.stride(0) == 0 for v in body.values())

    def _body_rows(self, body: Params, x: Tensor, draws: Tensor | None = None) -> Tensor:
        """φ(x) of rows ``x`` with one body, in chunks (``channels_last`` for images), each chunk augmented with
        its ``draws`` first when given."""
        xs = x.split(feature_chunk(self.device))
        ds = [None] * len(xs) if draws is None else draws.split(feature_chunk(self.device))
        return torch.cat(
            [sequential_forward(self.net.body, body, channels_last(c if d is None else self.augment.apply(c, d)))
             for c, d in zip(xs, ds, strict=True)]
        )  # fmt: skip

    @torch.no_grad()
    def _body_pass(self, body: Params, shared: bool, x: Tensor) -> Tensor:
        """φ(x) for ``x`` ``[K, M, ...]`` (client k's rows with client k's body): ONE pass over the cohort's
        rows in large chunks when the body is shared, else client by client."""
        self.feature_passes += 1
        if shared:
            feats = self._body_rows({n: v[0] for n, v in body.items()}, x.reshape(-1, *x.shape[2:]))
            return feats.view(x.shape[0], x.shape[1], *feats.shape[1:])
        return torch.stack([self._body_rows(unstack(body, k), x[k]) for k in range(x.shape[0])])

    @torch.no_grad()
    def _features(self, params: Params) -> Tensor:
        """φ(x) of every client's training rows with its (frozen) body, in ``data`` order: ``[N, ...]``."""
        body, shared = self._body_of(params)
        if shared:
            return self._body_pass(body, True, self.data[0].unsqueeze(0))[0]
        self.feature_passes += 1
        return torch.cat([self._body_rows(unstack(body, k), x) for k, x in enumerate(self.xs)])

    # ---- SGD --------------------------------------------------------------------------------------------------
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
        """``ClientContext.sgd`` for every client at once (same batches, same steps, same result). Parameters it
        does not train are returned as given (not copied), BatchNorm buffers as the clients' forward passes left
        them."""
        out = {n: t.detach() for n, t in params.items()}
        collect = None if objective is None else objective.collect
        self.class_sums_seen = None
        if collect is not None:
            self.class_sums_seen = empty_class_sums(collect, self.device, clients=(self.num_clients,))
        if not trainable or epochs <= 0 or self.num_clients == 0:
            return out
        if penalty is not None and not isinstance(penalty, Penalty):
            penalty = Penalty(lambda p, _, fn=penalty: fn(p))
        lr = self.optimizer.lr if lr is None else lr
        trainable = list(trainable)
        bs = batch_size or self.optimizer.batch_size
        min_batch = self.optimizer.min_batch(bs, self.net) if min_batch is None else min_batch  # drop_last
        phase = Phase(trainable, epochs, penalty, lr, max_steps, gradient, bs, min_batch, objective)
        paths = self.sub_paths()  # the run's (executor.decide), or this context's own plan
        # what stays with the phase: a custom step or objective trains the whole network's way
        head_only = paths.head is not None and gradient is None and objective is None and all(
            n.startswith("head.") for n in trainable)  # fmt: skip
        if not head_only and paths.sgd == "in turn":
            return self._sgd_client_by_client(out, phase)
        custom = gradient is not None or objective is not None or self.sides is not None
        if not head_only and custom and own_stacked_forward(self.net) is not None:
            say_once(self.net, "own_stacked", logging.WARNING,  # its stacked forward has no per-client vmap form
                     "vectorized executor: a custom step on %s: clients run in turn", type(self.net).__name__)
            return self._sgd_client_by_client(out, phase)
        if not head_only and paths.sgd == "conv in turn":
            if gradient is None and self.sides is None and self.optimizer_state is None:
                return self._sgd_in_turn(out, phase)
            return self._sgd_client_by_client(out, phase)
        form = paths.head if head_only else paths.sgd
        return self._sgd_batched(batched_rule(self.optimizer), head_only, form, out, phase)

    def sub_paths(self) -> StackedPaths:
        """The run's ``StackedPaths`` as given (``executor.decide``, whose line names them), else planned once from
        this context; a plan that runs the clients in turn for a reason says why, once per network, unless the
        run's executor line has (``notes.say_once``, key ``executor``)."""
        if self.paths is None:
            self.paths = plan_stacked(
                self.net, self.device, self.optimizer, self.augment, self._per_sample is per_sample_cross_entropy,
                self.sides is not None, self.cache_features, self.loop_over_clients,
            )  # fmt: skip
            if self.paths.why is not None:
                say_once(self.net, "executor", logging.WARNING, "vectorized executor: %s: clients run in turn",
                         self.paths.why)  # fmt: skip
        return self.paths

    def _caps(self, max_steps: MaxSteps) -> int | None | list[int]:
        """Each client's step cap (a function of its size and budget), or the one cap of all."""
        if callable(max_steps):
            return [max_steps(n, b) for n, b in zip(self.sizes, self.step_budgets)]
        return max_steps

    def _plan(self, epochs: int, bs: int, min_batch: int, max_steps: MaxSteps) -> PhasePlan:
        """This phase's ``plan_phase`` for the cohort (augmentation draws made ahead where the augmentation can)."""
        augment = self.augment if draws_ahead(self.augment) else None
        return plan_phase(
            self.sizes, self.offsets, self.generators, self.step_budgets, augment,
            epochs, bs, min_batch, self._caps(max_steps), self.device,
        )  # fmt: skip

    def _sgd_batched(self, rule: BatchedRule, head_only: bool, form: SgdPath, out: Params, phase: Phase) -> Params:
        """The phase's steps for every client at once, in ``form`` (``StackedPaths``: the network's, or the head's
        on the frozen body's features computed ahead when ``head_only``)."""
        plan = self._plan(phase.epochs, phase.bs, phase.min_batch, phase.max_steps)
        self.steps_taken = plan.steps
        if plan.num_steps == 0:
            self.train_loss = torch.zeros(self.num_clients, device=self.device)
            return out
        data_x, data_y = self.data
        valid = plan.rows >= 0
        rows = plan.rows.clamp(min=0)
        mask_all = valid.to(data_x.dtype if data_x.is_floating_point() else torch.get_default_dtype())
        active_all = valid[:, :, 0]
        penalty, lr = phase.penalty, phase.lr

        if head_only:
            module, names = self.net.head, {n: n[len("head.") :] for n in out if n.startswith("head.")}
            body, shared = self._body_of(out)
            batch_inputs = self._feature_batches(body, shared, rows, plan.draws)
        else:
            module, names = self.net, {n: n for n in out}

            def batch_inputs(s: int) -> Tensor:
                x = data_x[rows[s]]
                if plan.draws is not None:
                    x = self.augment.apply(x.flatten(0, 1), plan.draws[s].flatten(0, 1)).view(x.shape)
                return x

        batchnorm = FunctionalBatchNorm(self.net) if has_batchnorm(self.net) and not head_only else None
        stacked = phase.gradient is None and phase.objective is None and form != "vmap"
        step = None if stacked else compiled_step(self._vmapped_step(module, names, phase, batchnorm), self.net)
        stacked_step = compiled_step(self._stacked_step, self.net)  # model.compile (engine.compiled), else eager
        # a ReLU network with the cross-entropy and no penalty to differentiate: its gradient by hand
        by_hand = stacked and form == "fused relu mlp" and (penalty is None or penalty.gradient is not None)
        layers = relu_layers(module) if by_hand else None

        train = {n: out[n] for n in phase.trainable}
        frozen = {n: v for n, v in out.items() if n not in train}
        pdata = {} if penalty is None else penalty.data
        odata = {} if phase.objective is None else phase.objective.data
        wd = rule.weight_decay
        kept = self.optimizer_state
        # a fresh optimiser for this phase, or each client's kept state (names outside the model start fresh)
        state = {n: rule.init(v) for n, v in train.items()}
        count = {n: torch.zeros(self.num_clients, dtype=torch.long, device=self.device) for n in train}
        for n in train if kept is not None else ():
            if state_name(STEPS, n) in kept:
                state[n] = {k: kept[state_name(k, n)] for k in rule.keys}
                count[n] = kept[state_name(STEPS, n)].clone()
        decays = {n: wd if self.optimizer.decay_bias or not n.endswith("bias") else 0.0 for n in train}
        loss_sum = torch.zeros(self.num_clients, dtype=mask_all.dtype, device=self.device)
        fewest = min(plan.host_steps)
        changed: set[str] = set()
        with self._functional_batchnorm(batchnorm):
            for s in range(plan.num_steps):
                active, mask = active_all[s], mask_all[s]
                everyone = s < fewest  # every client steps (known on the host): nothing to mask
                x, y = batch_inputs(s), data_y[rows[s]]
                if step is None:
                    grads, losses = stacked_step(module, names, train, frozen, x, y, mask, penalty, pdata, layers)
                    sets, extra = {}, {}
                else:
                    grads, losses, sets, extra = step(train, frozen, x, y, mask, self.sides, pdata, odata)
                if "values" in extra:  # the rows of each client's last epoch (Objective.collect)
                    last = (active & (plan.last_epoch <= s)).to(mask.dtype)
                    self._collect(extra["values"], y, mask * last[:, None])
                stepped = rule.step_all([train[n] for n in grads], list(grads.values()), [state[n] for n in grads],
                                        [count[n] for n in grads], lr, [decays[n] for n in grads])  # fmt: skip
                for (n, g), (new_p, new_state) in zip(grads.items(), stepped):
                    if everyone:
                        train[n], state[n] = new_p, new_state
                        if rule.reads_count:
                            count[n] = count[n] + 1
                        continue
                    train[n] = torch.where(per_row(active, g), new_p, train[n])
                    state[n] = {k: torch.where(per_row(active, v), v, state[n][k]) for k, v in new_state.items()}
                    count[n] = count[n] + active.long()
                for n, v in sets.items():  # untrained values the step set (BatchNorm statistics, pFedMe's θ̃)
                    v = v.to(frozen[n].dtype)
                    frozen[n] = v if everyone else torch.where(per_row(active, v), v, frozen[n])
                    changed.add(n)
                step_loss = losses.detach().to(loss_sum.dtype)
                loss_sum = loss_sum + (step_loss if everyone else torch.where(active, step_loss, 0.0))
        self.train_loss = loss_sum / plan.steps.clamp(min=1)
        if not rule.reads_count:  # the steps every client took, counted once (they come first)
            count = {n: c + min(fewest, plan.num_steps) for n, c in count.items()}
        if kept is not None:
            self.optimizer_state = dict(kept)
            for n in train:
                if state_name(STEPS, n) not in kept:
                    continue
                self.optimizer_state[state_name(STEPS, n)] = count[n]
                for k, v in state[n].items():
                    self.optimizer_state[state_name(k, n)] = v
        out.update({n: v.detach() for n, v in train.items()})
        out.update({n: frozen[n].detach() for n in changed})
        return out

    @contextmanager
    def _functional_batchnorm(self, batchnorm: FunctionalBatchNorm | None) -> Iterator[None]:
        """A phase with per-client BatchNorm statistics (``batchnorm`` installed on the network), or without."""
        if batchnorm is None:
            yield
            return
        self._batchnorm = batchnorm
        try:
            with batchnorm:
                yield
        finally:
            self._batchnorm = None

    def _collect(self, values: Tensor, y: Tensor, weight: Tensor) -> None:
        """Add a step's per-sample ``values`` ``[K, B, D]`` (rows weighted by ``weight``: the real rows of the
        clients in their last epoch) to ``class_sums_seen`` by class."""
        sums, counts = self.class_sums_seen
        onehot = F.one_hot(y, sums.shape[1]).to(values.dtype) * weight.to(values.dtype)[..., None]  # [K, B, C]
        self.class_sums_seen = (
            sums.to(values.dtype) + torch.einsum("kbc,kbd->kcd", onehot, values.detach()),
            counts.to(values.dtype) + onehot.sum(1),
        )

    def _feature_batches(
        self, body: Params, shared: bool, rows: Tensor, draws: Tensor | None
    ) -> Callable[[int], Tensor]:
        """Step ``s`` → the frozen body's features of every client's minibatch ``[K, bs, ...]``. Without
        augmentation each client's rows pass the body once; with it, the augmented batches of a block of steps
        pass it together (the cohort as one large batch when the body is shared)."""
        if draws is None:
            feats = self._features({"body." + n: v for n, v in body.items()})
            return lambda s: feats[rows[s]]
        data_x = self.data[0]
        k, bs = rows.shape[1], rows.shape[2]
        block = max(1, feature_chunk(self.device) * (20 if self.device.type == "cpu" else 1) // (k * bs))
        cache: dict[int, Tensor] = {}

        def features(s: int) -> Tensor:
            start = s - s % block
            if start not in cache:
                cache.clear()
                r, d = rows[start : start + block], draws[start : start + block]
                if shared:  # the block's rows in plan order [steps, K, bs], augmented chunk by chunk
                    self.feature_passes += 1
                    with torch.no_grad():
                        f = self._body_rows({n: v[0] for n, v in body.items()}, data_x[r.reshape(-1)], d.flatten(0, 2))
                    cache[start] = f.view(*r.shape, *f.shape[1:])
                else:
                    x = self.augment.apply(data_x[r.reshape(-1)], d.reshape(-1, d.shape[-1]))
                    x = x.view(r.shape[0], k, bs, *x.shape[1:]).transpose(0, 1).reshape(k, -1, *x.shape[1:])
                    f = self._body_pass(body, shared, x)  # [K, block·bs, ...]
                    cache[start] = f.view(k, r.shape[0], bs, *f.shape[2:]).transpose(0, 1)
            return cache[start][s - start]

        return features

    def _stacked_step(
        self,
        module: nn.Module,
        names: dict[str, str],
        train: Params,
        frozen: Params,
        x: Tensor,
        y: Tensor,
        mask: Tensor,
        penalty: Penalty | None,
        pdata: Params,
        layers: list[Layer] | None = None,
    ) -> tuple[Params, Tensor]:
        """Every client's gradient from one batched forward (``stacked_forward``) and ordinary autograd on the
        sum of the client losses (each client's loss depends only on its own parameters), or by hand for a ReLU
        network (``layers``: ``relu_net_gradient``); a penalty with a closed-form gradient adds it without
        autograd."""
        closed = penalty is not None and penalty.gradient is not None
        if layers is not None:
            local = {names[n]: v for n, v in {**frozen, **train}.items() if n in names}
            found, losses = relu_net_gradient(layers, local, x, y, mask, {names[n] for n in train if n in names})
            grads = {n: found[names[n]] if n in names and names[n] in found else torch.zeros_like(v)
                     for n, v in train.items()}  # fmt: skip
        else:
            with torch.enable_grad():
                leaves = {n: v.detach().requires_grad_(True) for n, v in train.items()}
                full = {**frozen, **leaves}
                out = stacked_forward(module, {names[n]: v for n, v in full.items() if n in names}, x)
                per = self.per_sample_loss(out.flatten(0, 1), y.flatten(0, 1)).view(mask.shape)
                losses = (per * mask).sum(1) / mask.sum(1).clamp(min=1)
                if penalty is not None and not closed:
                    losses = losses + vmap(penalty.fn)(full, pdata)
                found = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
            grads = {n: torch.zeros_like(v) if g is None else g for (n, v), g in zip(leaves.items(), found)}
        if closed:  # the term's gradient and value in one vmap
            with torch.no_grad():
                values = {**frozen, **train}
                extra, value = vmap(lambda p, d: (penalty_gradient(penalty, p, list(train), d), penalty.fn(p, d)))(
                    values, pdata
                )
                grads = {n: g + extra[n] if n in extra else g for n, g in grads.items()}
                losses = losses.detach() + value
        return grads, losses

    def _vmapped_step(
        self, module: nn.Module, names: dict[str, str], phase: Phase, batchnorm: FunctionalBatchNorm | None
    ) -> Callable:
        """``vmap`` over clients of one client's (gradient, loss, values set) on its padded minibatch: the network's
        loss or the phase's ``Objective``, plus its ``Penalty``, or its ``Gradient``; BatchNorm statistics of the
        client's own batch (``FunctionalBatchNorm``), returned among the values the step sets."""
        penalty, gradient, objective = phase.penalty, phase.gradient, phase.objective

        def minibatch_loss(full: Params, x: Tensor, y: Tensor, m: Tensor, od: Params) -> tuple[Tensor, Params]:
            """(the loss, {"logged": the reported value, "values": the per-sample values to collect} as present)."""
            if objective is None:
                return self._masked_loss(module, names, full, x, y, m), {}
            per, logged, *values = objective.losses(full, x, y, od)
            aux = {} if logged is per else {"logged": masked_mean(logged, m).detach()}
            if values and objective.collect is not None:
                aux["values"] = values[0].detach()
            return masked_mean(per, m), aux

        def client_step(p: Params, fz: Params, x: Tensor, y: Tensor, m: Tensor, side: Tensor | None, pd: Params,
                        od: Params):  # fmt: skip
            self._side = side
            if batchnorm is not None:
                batchnorm.begin(m)
            try:
                sets: Params = {}
                aux: Params = {}
                if gradient is None:
                    closed = penalty is not None and penalty.gradient is not None

                    def loss_of(q: Params) -> tuple[Tensor, Params]:
                        full = {**fz, **q}
                        loss, aux = minibatch_loss(full, x, y, m, od)
                        if penalty is not None and not closed:
                            loss = loss + penalty.fn(full, pd)
                        return loss, aux

                    g, (loss, aux) = grad_and_value(loss_of, has_aux=True)(p)
                    if closed:
                        full = {**fz, **p}
                        extra = penalty_gradient(penalty, full, list(p), pd)
                        g = {n: g[n] + extra[n] if n in extra else g[n] for n in p}
                        loss = loss + penalty.fn(full, pd)
                    loss = aux.pop("logged", loss)
                else:
                    full = {**fz, **p}
                    g, loss, *rest = gradient(full, x, y, m)
                    g = {n: g[n] for n in p}
                    if penalty is not None:
                        extra = penalty_gradient(penalty, full, list(p), pd)
                        g = {n: g[n] + extra[n] if n in extra else g[n] for n in p}
                    sets.update(rest[0] if rest else {})
                if batchnorm is not None:
                    sets.update(batchnorm.updates(fz))
                return g, loss, sets, aux
            finally:
                self._side = None

        def step(p, fz, x, y, m, sides, pd, od):
            dims = (0, 0, 0, 0, 0, None if sides is None else 0, 0, 0)
            return vmap(client_step, in_dims=dims)(p, fz, x, y, m, sides, pd, od)

        return step
