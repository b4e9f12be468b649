"""The run's result row (``summary.json``): what the experiment runner, the reports and W&B's summary read.

``final``, ``last10`` and ``best`` come from the per-round validation history of the plain run; a "+FT" result
is a separate evaluation of the same run and keeps its own names (``final_ft``, ``final_ft_{std,worst10,min}``),
so no table mixes the two. Held-out new clients, the prediction shares of the collapse check and, under DP, ε are
added when they apply.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from fl_lightning.engine import executor
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.evaluation import ClientEvaluation, EvaluatedRun, class_shares, main_metric
from fl_lightning.engine.privacy import PrivacyEngine


class FinishedRun(EvaluatedRun, Protocol):
    """What the summary reads of a ``FederatedModule`` at the end of its fit (not imported: it imports this file)."""

    fed: FederatedData
    history: list[dict[str, float]]
    eval_last: int
    rounds_trained: int
    upload_bytes: float
    privacy: PrivacyEngine | None
    last_evaluation: ClientEvaluation | None
    final_clients: ClientEvaluation | None
    loggers: list[Any]
    validation_split: str
    device: torch.device

    def wall_seconds(self) -> float: ...

    def end_evaluations(self, round_idx: int, split: str) -> dict[str, float]: ...


def run_summary(module: FinishedRun) -> dict[str, Any]:
    """The summary of ``module``'s fit, after its last round's validation; runs the end-of-training evaluations
    ("+FT", new clients), logs them, and sets ``module.final_clients`` (the per-client rows of ``clients.csv``)."""
    key = main_metric(module.fed)
    last = module.history[-1] if module.history else {}
    recent = module.history[-module.eval_last :]
    lower_is_better = module.fed.num_classes is None
    values = [h[key] for h in module.history]
    summary = {
        "algorithm": type(module.algorithm).__name__ + ("+FT" if module.finetune else ""),
        "rounds": module.rounds_trained,
        "final": last.get(key, float("nan")),
        "last10": sum(h[key] for h in recent) / max(len(recent), 1),
        "best": (min(values) if lower_is_better else max(values)) if values else float("nan"),
        "wall_s": module.wall_seconds(),
        "upload_bytes": module.upload_bytes,
        "metric": key.split("/")[1].replace("_mean", ""),
    }
    if not module.history:  # evaluation off (trainer.limit_val_batches 0): no figure, rather than NaN or a fake 0
        for name in ("final", "last10", "best"):
            del summary[name]
        summary["evaluations"] = 0
    if module.device.type == "cuda":  # this process's peak device memory (experiment.gpu_share: --jobs auto)
        summary["peak_device_mb"] = torch.cuda.max_memory_allocated(module.device) / 2**20
    if module.privacy is not None:
        summary.update(module.privacy.summary(module.rounds_trained, final=True))
    if module.fed.num_classes is not None:
        summary["classes"] = module.fed.num_classes  # chance accuracy is 1/classes (the report flags a collapse)
    if "val/dist_B" in last:
        summary["dist_B"] = last["val/dist_B"]
    end = module.end_evaluations(module.rounds_trained - 1, split=module.validation_split)
    for name in ("acc", "mse"):
        if f"final/new_clients_{name}" in end:
            summary[f"new_clients_{name}"] = end[f"final/new_clients_{name}"]
    if module.fed.num_classes is not None and module.bank is not None:  # the collapse check (a bank: data attached)
        summary.update(class_shares(module, module.validation_split))
    module.final_clients = module.last_evaluation
    # final, last10, best and final_{std,worst10,min} are always the plain run's; X+FT is an evaluation of the
    # same run, kept under its own names (final_ft, final_ft_{std,worst10,min}), so no table mixes the two
    figures = [("final", module.last_evaluation)]
    if "final/acc_ft" in end:
        summary["final_ft"] = end["final/acc_ft"]
        figures.append(("final_ft", module.finetuned_clients))
        module.final_clients = module.finetuned_clients  # clients.csv: the per-client numbers of the "+FT" result
    for name, clients in figures:
        if clients is not None and clients.round == module.rounds_trained - 1:
            summary.update({f"{name}_{k.split('_', 1)[1]}": v for k, v in clients.spread(lower_is_better).items()})
    if end:
        for logger in module.loggers:
            logger.log_metrics(end, step=module.rounds_trained - 1)
    return summary



def what_ran(module: FinishedRun) -> dict[str, Any]:
    """The path that trained the run's clients (``executor.decide``: ``stacked`` or ``sequential``, and why) and
    the batched job it shared (its runs, and those whose clients trained in one call with its own), or ``None``
    for a run alone: ``summary.json``'s and the W&B config's ``ran``."""
    decision = executor.decided(module)
    return {
        "executor": None if decision is None else decision.path,
        "reason": None if decision is None else decision.reason,
        "batch": None if module.run_axis is None else module.run_axis.describe(module),
    }
