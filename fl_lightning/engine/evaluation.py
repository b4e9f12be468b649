"""Evaluation: every client evaluates its own model (global shared parts + its own personal state) on its
own test split, and the papers' metrics are computed from the per-client numbers.

Validation reads each client's validation split when the DataModule carved one (``data.val_fraction`` > 0)
and its test split otherwise (what the papers report); ``test`` always reads the test split.

In Lightning terms this is the validation loop. The validation "dataloader" (``rounds.ClientChunks``) yields chunks
of this rank's client ids; ``FederatedModule.validation_step`` scores a chunk with ``evaluate_clients`` into
``PerClientScores`` (per-client sums, sum-reduced over ranks); ``on_validation_epoch_end`` turns them into a
``ClientEvaluation`` and logs ``validation_metrics``: the mean of the per-client accuracies (FedRep, spec 000
§3.2), the sample-weighted accuracy, the mean per-client loss (or MSE for regression), and for the linear
representation the principal-angle distance to the true representation (spec 000 Definition 1).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.client import Params, make_generator
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.executor import FederatedRun, client_context, evaluation_route, vector_context
from fl_lightning.engine.rounds import CLIENTS_PER_STEP, ClientChunks, client_chunks, floyd_sample
from fl_lightning.engine.stacked import FEATURE_CHUNK
from fl_lightning.engine.stacked_nets import pad_rows, stack, stackable, stacked_forward
from fl_lightning.engine.state import ClientStateBank
from fl_lightning.errors import ConfigError
from fl_lightning.metrics import PerClientScores, client_spread, principal_angle_distance

__all__ = ["CLIENTS_PER_STEP", "ClientChunks", "ClientEvaluation", "FineTune", "client_chunks", "evaluate_clients"]

class EvaluatedRun(FederatedRun, Protocol):
    """What evaluation reads of a ``FederatedModule`` (not imported: it imports this file), besides what the
    executor reads (``FederatedRun``)."""

    bank: ClientStateBank | None
    client_scores: PerClientScores
    finetune: FineTune | None
    new_client_finetune: FineTune
    finetuned_clients: ClientEvaluation | None
    global_rank: int
    attached_trainer: Any  #: Lightning's trainer, or None outside a fit

    def global_params(self) -> Params: ...

    def data_dtype(self) -> torch.dtype | None: ...

    def evaluate_clients(
        self,
        round_idx: int,
        finetune: FineTune | None = None,
        state_of: Callable[[int], Params] | None = None,
        split: str = "test",
    ) -> dict[str, Tensor]: ...

    def evaluate_new_clients(self, round_idx: int, new: FederatedData) -> dict[str, Tensor]: ...


#: the run the functions below evaluate
Module = EvaluatedRun

@dataclass
class FineTune:
    """ "+FT" (spec 000 §2.4): after training, each client fine-tunes the parameters under ``prefixes`` for
    ``epochs`` epochs of local SGD on its training data, and is evaluated once with the result.

    The default is the whole model (``prefixes=("",)``), as FedBABU's authors (``analysis.ipynb`` of
    github.com/jhoon-oh/FedBABU: one SGD over ``body_params`` and ``head_params``) and PFLlib (``clientBABU.fine_tune``
    over ``base`` and ``head``) fine-tune. The head only is :meth:`head_only` (``prefixes: [head.]`` in a config):
    FedRep's "+FT" rows and its new-client protocol."""

    epochs: int = 10
    prefixes: tuple[str, ...] = ("",)

    @classmethod
    def head_only(cls, epochs: int = 10) -> FineTune:
        """Fine-tune the head (``head.``) only, the body frozen."""
        return cls(epochs, ("head.",))


@dataclass
class ClientEvaluation:
    """One evaluation of every client: the per-client tensors ``[num_clients]`` and their summaries."""

    round: int
    acc_per_client: Tensor
    loss_per_client: Tensor
    acc_mean: float
    acc_weighted: float
    loss_mean: float
    samples_per_client: Tensor | None = None  #: test samples of each client (0: the client has none)

    @classmethod
    def from_scores(cls, scores: dict[str, Tensor], round_idx: int) -> ClientEvaluation:
        samples = scores.get("samples_per_client")
        return cls(
            round_idx,
            scores["acc_per_client"].detach().cpu(),
            scores["loss_per_client"].detach().cpu(),
            float(scores["acc_mean"]),
            float(scores["acc_weighted"]),
            float(scores["loss_mean"]),
            None if samples is None else samples.detach().cpu(),
        )

    def spread(self, regression: bool = False) -> dict[str, float]:
        """The spread over clients with test data (``fl_lightning.metrics.client_spread``), named as logged:
        ``acc_std``, ``acc_worst10``, ``acc_min`` (regression: ``mse_std``, ``mse_worst10``, ``mse_max``)."""
        samples = self.samples_per_client
        if samples is None:
            samples = torch.ones_like(self.acc_per_client)
        if regression:
            s = client_spread(self.loss_per_client, samples, higher_is_better=False)
            return {"mse_std": s["std"], "mse_worst10": s["worst10"], "mse_max": s["worst"]}
        s = client_spread(self.acc_per_client, samples)
        return {"acc_std": s["std"], "acc_worst10": s["worst10"], "acc_min": s["worst"]}

    def rows(self) -> list[dict[str, float]]:
        """One row per client: ``client, samples, accuracy, loss`` (``clients.csv``, the W&B table). A client with
        no test rows has no accuracy and no loss (NaN; an empty cell in ``clients.csv``), not a failing 0 %."""
        samples = self.samples_per_client
        nan = float("nan")
        return [
            {
                "client": c,
                "samples": int(samples[c]) if samples is not None else -1,
                "accuracy": float(self.acc_per_client[c]) if samples is None or samples[c] > 0 else nan,
                "loss": float(self.loss_per_client[c]) if samples is None or samples[c] > 0 else nan,
            }
            for c in range(self.acc_per_client.numel())
        ]


def validation_metrics(result: ClientEvaluation, fed: FederatedData, net: nn.Module, prefix: str = "val") -> dict:
    """The logged metrics of one evaluation (``prefix/acc_mean``… or ``prefix/mse_mean`` for regression)."""
    metrics: dict[str, float] = {}
    if fed.num_classes is None:
        metrics[f"{prefix}/mse_mean"] = result.loss_mean
    else:
        metrics[f"{prefix}/acc_mean"] = result.acc_mean
        metrics[f"{prefix}/acc_weighted"] = result.acc_weighted
        metrics[f"{prefix}/loss"] = result.loss_mean
    metrics.update({f"{prefix}/{k}": v for k, v in result.spread(fed.num_classes is None).items()})
    if "B_star" in fed.extras and hasattr(net, "representation"):
        metrics[f"{prefix}/dist_B"] = float(principal_angle_distance(fed.extras["B_star"], net.representation.detach()))
    return metrics


def main_metric(fed: FederatedData, prefix: str = "val") -> str:
    """The headline metric: ``val/acc_mean`` (classification) or ``val/mse_mean`` (regression)."""
    return f"{prefix}/mse_mean" if fed.num_classes is None else f"{prefix}/acc_mean"


def validation_metric_names(fed: FederatedData, net: nn.Module) -> set[str]:
    """Every key ``FederatedModule.on_validation_epoch_end`` logs (a callback may monitor any of them)."""
    key = main_metric(fed)
    names = {key, key.replace("_mean", "_last10")}
    spread = ("mse_std", "mse_worst10", "mse_max") if fed.num_classes is None else ("acc_std", "acc_worst10", "acc_min")
    names |= {f"val/{k}" for k in spread}
    if fed.num_classes is not None:
        names |= {"val/acc_weighted", "val/loss"}
    if "B_star" in fed.extras and hasattr(net, "representation"):
        names.add("val/dist_B")
    return names


def check_monitored_keys(fed: FederatedData, net: nn.Module, callbacks: list[Any]) -> None:
    """A callback that monitors a ``val/`` key that is never logged is a config error (named up front)."""
    logged = validation_metric_names(fed, net)
    for callback in callbacks:
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str) and monitor.startswith("val/") and monitor not in logged:
            raise ConfigError(
                f"{type(callback).__name__} monitors '{monitor}', which is never logged "
                f"(validation logs: {', '.join(sorted(logged))})"
            )


def mean_of_last(history: list[dict[str, float]], key: str, count: int) -> float:
    """The mean of ``key`` over the last ``count`` evaluations (the papers' "last 10 rounds" average; all of
    them when ``count`` is 0)."""
    recent = [h[key] for h in history[-count:]]
    return sum(recent) / len(recent) if recent else float("nan")


# ---- when to evaluate ----------------------------------------------------------------------------------------
def in_last_rounds(trainer: Any, eval_last: int, round_idx: int) -> bool:
    """Whether ``round_idx`` is one of the last ``eval_last`` rounds (always evaluated)."""
    return round_idx >= trainer.max_steps - eval_last


def validates_after(trainer: Any, eval_last: int, round_idx: int) -> bool:
    """Whether Lightning's validation loop runs after round ``round_idx``: one of the last ``eval_last`` rounds,
    or a round the trainer's ``val_check_interval`` (in rounds) falls on."""
    if not trainer.enable_validation:
        return False
    if in_last_rounds(trainer, eval_last, round_idx):
        return True
    every = trainer.val_check_batch
    if every is None:  # a time-based interval: not known in advance
        return False
    if every == float("inf"):
        return round_idx == trainer.max_steps - 1
    return (round_idx + 1) % int(every) == 0


# ---- scoring ---------------------------------------------------------------------------------------------
def score_outputs(out: Tensor, y: Tensor, num_classes: int | None) -> tuple[Tensor | float, int, Tensor]:
    """(correct predictions, samples, summed loss) of one client's test outputs; the sums stay on the device."""
    if num_classes is None:
        return 0.0, y.shape[0], ((out.to(torch.promote_types(out.dtype, y.dtype)) - y) ** 2).sum()
    loss = torch.nn.functional.cross_entropy(out.float(), y, reduction="sum")
    return (out.argmax(-1) == y).sum(), y.shape[0], loss


@torch.no_grad()
def score_client(
    net: nn.Module,
    fed: FederatedData,
    client: int,
    params: Params,
    split: str = "test",
    predict: Callable[[nn.Module, Params, Tensor, Tensor | None], Tensor] | None = None,
) -> tuple[Tensor | float, int, Tensor | float]:
    """Score ``params`` on the client's ``split`` (``test`` or ``val``), in slices of 2048 samples; ``predict``
    (an algorithm's ``Algorithm.predict``) computes the outputs, by default the network's forward."""
    x, y = fed.evaluation_split(split).client(client)
    if x.shape[0] == 0:
        return 0.0, 0, 0.0
    side = None if fed.side is None else fed.side[client]
    total = [0.0, 0, 0.0]
    for i in range(0, x.shape[0], 2048):
        xb = x[i : i + 2048]
        sb = None if side is None else side.expand(xb.shape[0], *side.shape)
        if predict is None:
            out = functional_call(net, params, (xb,), {"side": sb}, strict=False)
        else:
            out = predict(net, params, xb, sb)
        for j, v in enumerate(score_outputs(out, y[i : i + 2048], fed.num_classes)):
            total[j] += v
    return total[0], int(total[1]), total[2]


def data_to_device(fed: FederatedData, where: tuple[torch.device, torch.dtype | None], moved: Any) -> tuple[Any, Any]:
    """``fed`` on ``where`` (device, dtype; ``FederatedData.to``) and the mark of that move; data that the previous
    call's mark ``moved`` says it moved there is returned as it is (moving it again would build an equal copy)."""
    if moved is not None and moved[0] is fed and moved[1] == where:
        return fed, moved
    fed = fed.to(*where)
    return fed, (fed, where)


def evaluate_clients(
    module: Module,
    clients: list[int],
    round_idx: int,
    scores: PerClientScores,
    finetune: FineTune | None = None,
    state_of: Callable[[int], Params] | None = None,
    split: str = "test",
    fed: FederatedData | None = None,
) -> None:
    """Each client in ``clients`` of ``fed`` (default: the run's data) evaluates (global shared +
    ``state_of(client)``; default: its bank row), optionally adapted (``Algorithm.adapt_for_evaluation``) or
    fine-tuned first, on its own ``split``; the sums go into ``scores``. Local adaptation runs in train mode with
    gradients, scoring in eval mode."""
    net, algorithm = module.net, module.algorithm
    fed = module.fed if fed is None else fed
    was_training = net.training
    glob = module.global_params()
    state_of = state_of or module.bank.get
    with torch.inference_mode(False), torch.enable_grad():
        path = evaluation_route(module, finetune, len(clients), fed)  # the run's decided path (executor.decide)
        if path == "shared body":
            _evaluate_with_shared_body(module, clients, glob, round_idx, finetune, state_of, scores, split, fed)
        elif path == "stacked":
            _score_stacked(module, clients, glob, state_of, scores, split, round_idx, fed)
        else:
            for c in clients:
                params = algorithm.client_model(glob, state_of(c))
                net.train()
                ctx = client_context(module, c, round_idx, tag="evaluation", fed=fed)
                params = algorithm.adapt_for_evaluation(ctx, params)
                if finetune is not None:
                    params = algorithm.finetune(ctx, params, finetune.epochs, finetune.prefixes)
                net.eval()
                scores.update(c, *score_client(net, fed, c, params, split, algorithm.predict))
    net.train(was_training)


def evaluate_all(
    module: Module,
    round_idx: int,
    finetune: FineTune | None = None,
    state_of: Callable[[int], Params] | None = None,
    split: str = "test",
    fed: FederatedData | None = None,
    scores: PerClientScores | None = None,
) -> dict[str, Tensor]:
    """Evaluate all of this rank's clients of ``fed`` (default: the run's data, into ``module.client_scores``) now
    (outside the validation loop), ``CLIENTS_PER_STEP`` clients at a time (memory bounded by the chunk, not by N);
    per-client and mean scores."""
    trainer = module.attached_trainer
    world, rank = (trainer.world_size, module.global_rank) if trainer is not None else (1, 0)
    fed = module.fed if fed is None else fed
    scores = module.client_scores if scores is None else scores
    with torch.inference_mode(False):
        scores.reset()
        for chunk in ClientChunks(fed.num_clients, rank, world, size=CLIENTS_PER_STEP):
            evaluate_clients(module, chunk, round_idx, scores, finetune, state_of, split, fed)
        return scores.compute()


def evaluation_sample(num_clients: int, eval_clients: int | None, seed: int) -> list[int] | None:
    """The clients a periodic evaluation scores (``model.eval_clients``): ``eval_clients`` of them drawn from
    ``(seed, "eval_clients")`` in O(K) (Floyd), the same at every evaluation; None (every client) when unset or
    when it is not fewer than ``num_clients``."""
    if eval_clients is None or eval_clients >= num_clients:
        return None
    return floyd_sample(num_clients, eval_clients, make_generator(seed, "eval_clients")).tolist()


def sampled_sem(result: ClientEvaluation, population: int, regression: bool = False) -> float:
    """The standard error of the sampled mean over the clients with test data: s / √n · √((N − n)/(N − 1)), with
    s the sample standard deviation of the per-client figure and the finite-population correction (0 when all N
    clients are scored)."""
    values = result.loss_per_client if regression else result.acc_per_client
    samples = result.samples_per_client
    v = (values if samples is None else values[samples > 0]).double()
    n = v.numel()
    if n < 2:
        return float("nan")
    correction = max(population - n, 0) / max(population - 1, 1)
    return float(v.std(unbiased=True) / math.sqrt(n) * math.sqrt(correction))


def evaluate_new_clients(module: Module, round_idx: int, new: FederatedData) -> dict[str, Tensor]:
    """Clients that never trained (FedRep Fig. 6, spec 004 transfer): each starts from the global model with a
    fresh personal state (the initial personal parameters), fine-tunes ``module.new_client_finetune`` on its own
    training data, and is evaluated on its own test data. The run's own data and scores stay as they are: ``new``
    and its scores are handed to the evaluation."""
    fresh = module.algorithm.init_client_state(module.global_params())
    fed = new.to(module.device, module.data_dtype())
    scores = PerClientScores(new.num_clients).to(module.device)
    return evaluate_all(module, round_idx, module.new_client_finetune, lambda c: fresh, "test", fed, scores)


@torch.no_grad()
def class_shares(module: Module, split: str) -> dict[str, float]:
    """Whether the evaluated models collapsed onto one class (issue 31): over this process's clients' ``split``
    (summed over processes), the share of all predictions that fall in the most predicted class
    (``top_class_share``) and the share of the most frequent true label (``label_top_class_share``), each client
    scored with its plain model (``Algorithm.client_model``, no evaluation-time adaptation). A global model that
    predicts one class everywhere gives 1.0 where the labels give far less."""
    fed, net, algorithm = module.fed, module.net, module.algorithm
    trainer = module.attached_trainer
    world, rank = getattr(trainer, "world_size", 1), getattr(trainer, "global_rank", 0)
    predicted = torch.zeros(fed.num_classes, dtype=torch.long, device=module.device)
    labels = torch.zeros_like(predicted)
    glob, was_training = module.global_params(), net.training
    net.eval()
    for c in range(rank, fed.num_clients, world):
        x, y = fed.evaluation_split(split).client(c)
        if x.shape[0] == 0:
            continue
        params = algorithm.client_model(glob, module.bank.get(c))
        for i in range(0, x.shape[0], 2048):  # in slices, as score_client
            xb = x[i : i + 2048]
            side = None if fed.side is None else fed.side[c].expand(xb.shape[0], *fed.side[c].shape)
            out = algorithm.predict(net, params, xb, side)
            predicted += torch.bincount(out.argmax(-1), minlength=fed.num_classes)
        labels += torch.bincount(y, minlength=fed.num_classes)
    net.train(was_training)
    if world > 1:  # one sum over the processes of both histograms
        predicted, labels = trainer.strategy.reduce(torch.cat([predicted, labels]), reduce_op="sum").chunk(2)
    total = max(int(labels.sum()), 1)
    top_predicted, top_label = int(predicted.max()) / total, int(labels.max()) / total
    return {"top_class_share": top_predicted, "label_top_class_share": top_label}


def end_evaluations(module: Module, round_idx: int, split: str) -> dict[str, float]:
    """Held-out new clients (if the DataModule has them; their test split) and "+FT" (if configured)."""
    out: dict[str, float] = {}
    new = getattr(getattr(module.attached_trainer, "datamodule", None), "new_clients", None)
    if isinstance(new, FederatedData):  # accuracy, or for regression the mean squared error (issue 18)
        name, key = ("acc", "acc_mean") if module.fed.num_classes is not None else ("mse", "loss_mean")
        out[f"final/new_clients_{name}"] = float(module.evaluate_new_clients(round_idx, new)[key])
    if module.finetune is not None:
        ft = module.evaluate_clients(round_idx, finetune=module.finetune, split=split)
        out["final/acc_ft"] = float(ft["acc_mean"])
        module.finetuned_clients = ClientEvaluation.from_scores(ft, round_idx)
    return out


#: the stacked scoring pads every client of a group to the group's largest split: at most this many rows at once
STACKED_ROWS = 8192


def row_groups(sizes: list[int], cap: int) -> list[list[int]]:
    """The positions of ``sizes`` (rows per client) in order, grouped so that a group padded to its largest member
    holds at most ``cap`` rows; a position above ``cap // 2`` rows is a group of its own, one with 0 rows is left
    out (it has nothing to score)."""
    groups: list[list[int]] = []
    group: list[int] = []
    for k, n in enumerate(sizes):
        if n == 0:
            continue
        if n > cap // 2:
            groups.append([k])
            continue
        if group and (len(group) + 1) * max(n, *(sizes[g] for g in group)) > cap:
            groups.append(group)
            group = []
        group.append(k)
    return [*groups, group] if group else groups


def _stacked_apply(module: nn.Module, params: Params, x: Tensor) -> Tensor:
    """``module`` with client ``k``'s parameters on ``x[k]``: ``stacked_forward`` where it applies, else ``vmap``."""
    if stackable(module):
        return stacked_forward(module, params, x)
    return torch.func.vmap(lambda p, xb: functional_call(module, p, (xb,)))(params, x)


def _score_padded(out: Tensor, y: Tensor, sizes: list[int], clients: list[int], scores: PerClientScores) -> None:
    """``score_outputs`` of every client of a padded group at once (the padding masked out), into ``scores``."""
    k, width = y.shape
    n = torch.tensor(sizes, device=y.device)
    mask = torch.arange(width, device=y.device) < n.unsqueeze(1)
    per_sample = torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="none")
    loss = (per_sample.view(k, width) * mask).sum(1)
    correct = ((out.argmax(-1) == y) & mask).sum(1)
    scores.update(torch.tensor(clients, device=y.device), correct, n, loss)


@torch.no_grad()
def _score_stacked(
    module: Module, clients: list[int], glob: Params, state_of: Callable[[int], Params], scores: PerClientScores,
    split: str, round_idx: int, fed: FederatedData,
) -> None:  # fmt: skip
    """``score_client`` for many clients at once: their splits padded to one ``[K, n, ...]`` tensor per
    ``row_groups`` group, each client's model stacked (``_stacked_apply``; adapted first on a stacked context of
    the group's training data when the algorithm adapts), the padding masked out of the correct count and the summed
    cross-entropy. A client with more than ``STACKED_ROWS / 2`` rows is scored alone (``score_client``'s slices)."""
    net, algorithm, data = module.net, module.algorithm, fed.evaluation_split(split)
    adapts = type(algorithm).adapt_for_evaluation is not Algorithm.adapt_for_evaluation
    net.eval()
    pairs = [data.client(c) for c in clients]
    for group in row_groups([x.shape[0] for x, _ in pairs], STACKED_ROWS):
        ids = [clients[k] for k in group]
        alone = len(group) == 1 and pairs[group[0]][0].shape[0] > STACKED_ROWS // 2
        params = stack([algorithm.client_model(glob, state_of(c)) for c in ids])
        if adapts:  # in train mode with gradients, as the client-by-client loop adapts
            net.train()
            ctx = vector_context(module, ids, round_idx, [1.0] * len(ids), tag="evaluation", fed=fed)
            params = algorithm.adapt_for_evaluation(ctx, params)
            net.eval()
        if alone:
            mine = {n: v[0] for n, v in params.items()}
            scores.update(ids[0], *score_client(net, fed, ids[0], mine, split, algorithm.predict))
            continue
        out = _stacked_apply(net, params, pad_rows([pairs[k][0] for k in group]))
        _score_padded(out, pad_rows([pairs[k][1] for k in group]), [pairs[k][0].shape[0] for k in group], ids, scores)


@torch.no_grad()
def _evaluate_with_shared_body(
    module: Module,
    clients: list[int],
    glob: Params,
    round_idx: int,
    finetune: FineTune | None,
    state_of: Callable[[int], Params],
    scores: PerClientScores,
    split: str,
    fed: FederatedData,
) -> None:
    """Features once with the global body for all ``clients``' rows, then every client's head on its rows, the heads
    of a ``row_groups`` group at once on their clients' padded features (regression: client by client)."""
    net, test = module.net, fed.evaluation_split(split)
    heads = [
        {n: v for n, v in module.algorithm.client_model(glob, state_of(c)).items() if n.startswith("head.")}
        for c in clients
    ]
    if finetune is not None:
        with torch.enable_grad():
            heads = _finetune_heads(module, clients, glob, heads, round_idx, finetune, fed)
    net.eval()
    body = {n[len("body.") :]: v for n, v in glob.items() if n.startswith("body.")}
    spans = [(test.offsets[c], test.offsets[c + 1]) for c in clients]  # host offsets: no device reads
    sizes = [hi - lo for lo, hi in spans]
    if sum(sizes) == 0:
        return
    device = test.y.device
    x = test.x[torch.cat([torch.arange(lo, hi, device=device) for lo, hi in spans])]
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if stackable(net.body):  # one batched product per layer for all rows
        feats = stacked_forward(net.body, {n: v.unsqueeze(0) for n, v in body.items()}, x.unsqueeze(0))[0]
    else:
        feats = torch.cat([functional_call(net.body, body, (chunk,)) for chunk in x.split(FEATURE_CHUNK)])
    starts = [0, *itertools.accumulate(sizes)][:-1]
    heads = [{n[len("head.") :]: v for n, v in head.items()} for head in heads]
    if fed.num_classes is not None:
        groups = row_groups(sizes, STACKED_ROWS)
    else:  # regression: each client's head on its own rows
        groups = [[k] for k, n in enumerate(sizes) if n]
    for group in groups:
        if len(group) > 1:  # the group's heads at once on its clients' padded features
            out = _stacked_apply(net.head, stack([heads[k] for k in group]),
                                 pad_rows([feats[starts[k] : starts[k] + sizes[k]] for k in group]))  # fmt: skip
            ys = pad_rows([test.y[spans[k][0] : spans[k][1]] for k in group])
            _score_padded(out, ys, [sizes[k] for k in group], [clients[k] for k in group], scores)
            continue
        k = group[0]
        out = functional_call(net.head, heads[k], (feats[starts[k] : starts[k] + sizes[k]],))
        scores.update(clients[k], *score_outputs(out, test.y[spans[k][0] : spans[k][1]], fed.num_classes))


def _finetune_heads(
    module: Module, clients: list[int], glob: Params, heads: list[Params], round_idx: int, finetune: FineTune,
    fed: FederatedData,
) -> list[Params]:
    """ "+FT" for many clients at once (the frozen body's features are computed once per chunk)."""
    module.net.train()
    out: list[Params] = []
    for i in range(0, len(clients), 256):
        chunk = clients[i : i + 256]
        ctx = vector_context(module, chunk, round_idx, [1.0] * len(chunk), tag="evaluation", fed=fed)
        params = {n: v.expand(len(chunk), *v.shape) for n, v in glob.items()}
        params.update(stack(heads[i : i + 256]))
        tuned = ctx.sgd(params, ctx.params_with(finetune.prefixes), finetune.epochs)
        out += [{n: tuned[n][k] for n in heads[0]} for k in range(len(chunk))]
    return out
