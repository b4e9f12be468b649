"""Checkpoint identity: what a ``FederatedModule`` checkpoint must match to be loaded, and the run's own entries.

Besides Lightning's ``state_dict`` (global model, client-state bank, algorithm server state) a checkpoint
carries ``fl_identity`` (the algorithm and network classes), ``fl_history`` (the evaluations so far),
``fl_upload_bytes``, ``fl_wall_s`` (training seconds over every process that trained the run) and
``fl_skips_validation_of`` (a round whose validation the checkpoint was written before, or None).

A bank placed on the host or on disk (``model.client_state``, ``fl_lightning.engine.state``) is not in
``state_dict``: the checkpoint's ``fl_client_state`` lists the journal files (rows written since the previous
checkpoint, in ``<run_dir>/client_state/``) that rebuild it, so a checkpoint costs what changed, not N. Either
layout loads into either placement: a device-placed checkpoint's ``bank.*`` tables fill a host or disk bank, and a
journal rebuilds a device bank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from fl_lightning.algorithms.base import Algorithm
from fl_lightning.engine.state import ClientStateBank
from fl_lightning.errors import ConfigError

__all__ = ["checkpoint_mismatch", "identity", "load_entries", "save_entries"]

log = logging.getLogger("fl_lightning")


class CheckpointedRun(Protocol):
    """What a checkpoint reads and restores of a ``FederatedModule`` (not imported: it imports this file)."""

    algorithm: Algorithm
    net: nn.Module
    bank: ClientStateBank | None
    history: list[dict[str, float]]
    rounds_trained: int
    upload_bytes: float
    resumed_wall_s: float  #: training seconds before the checkpoint the run resumed from
    attached_trainer: Any  #: Lightning's trainer, or None outside a fit
    trainer: Any

    def state_dict(self) -> dict[str, Any]: ...

    def wall_seconds(self) -> float: ...

    def validates_after(self, round_idx: int) -> bool: ...


def identity(module: CheckpointedRun) -> dict[str, str]:
    """What a checkpoint must match: the algorithm and network classes."""
    return {
        "algorithm": f"{type(module.algorithm).__module__}.{type(module.algorithm).__qualname__}",
        "network": f"{type(module.net).__module__}.{type(module.net).__qualname__}",
    }


def checkpoint_mismatch(module: CheckpointedRun, checkpoint: dict[str, Any]) -> str | None:
    """Why ``checkpoint`` cannot be loaded into ``module`` (another algorithm, network or size), or None."""
    theirs, ours = checkpoint.get("fl_identity"), identity(module)
    if theirs and theirs != ours:
        short = {k: v.rsplit(".", 1)[-1] for k, v in theirs.items()}
        mine = {k: v.rsplit(".", 1)[-1] for k, v in ours.items()}
        return (
            f"the checkpoint was trained with {short['algorithm']} on {short['network']}, "
            f"this config is {mine['algorithm']} on {mine['network']}"
        )
    saved, expected = dict(checkpoint.get("state_dict", {})), dict(module.state_dict())
    bank = getattr(module, "bank", None)
    if bank is not None and bank.placement != "device":
        expected.update(bank.shapes())
    journal = checkpoint.get("fl_client_state")
    if journal is not None:
        saved.update({f"bank.{k}": _meta(journal["num_clients"], *v) for k, v in journal["shapes"].items()})
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    if missing or extra:
        return f"the checkpoint does not fit this model (missing: {missing[:3]}, unexpected: {extra[:3]})"
    for k, v in expected.items():
        theirs_shape, ours_shape = list(saved[k].shape), list(v.shape)
        if theirs_shape == ours_shape:
            continue
        if k.startswith("bank.") and theirs_shape[1:] == ours_shape[1:]:
            return f"the checkpoint has {theirs_shape[0]} clients, this config {ours_shape[0]}"
        return f"the checkpoint does not fit this model: {k} has shape {theirs_shape} there and {ours_shape} here"
    return None


def _meta(num_clients: int, shape: list[int], dtype: str) -> Any:
    import torch

    return torch.empty((num_clients, *shape), dtype=getattr(torch, dtype.removeprefix("torch.")), device="meta")


def journal_directories(module: CheckpointedRun) -> list[Path]:
    """Where a run keeps its client-state journal: ``<run_dir>/client_state`` (``trainer.default_root_dir``), and
    next to the checkpoint being loaded (``<run_dir>/checkpoints/x.ckpt`` → ``<run_dir>/client_state``)."""
    trainer = module.attached_trainer
    if trainer is None:
        return [module.bank.directory] if getattr(module.bank, "directory", None) else []
    root = getattr(trainer, "default_root_dir", None)
    out = [] if root is None else [Path(root) / "client_state"]
    if getattr(module.bank, "directory", None) is not None:
        out.append(module.bank.directory)
    ckpt = getattr(trainer, "ckpt_path", None)
    if ckpt:
        out.append(Path(ckpt).resolve().parent.parent / "client_state")
    return out


def _frozen_left_out(module: CheckpointedRun) -> list[str]:
    """Frozen network parameters a checkpoint leaves out: those of a network that asks for it
    (``checkpoint_frozen = False``: a pretrained base under LoRA adapters, rebuilt from its source on resume),
    unless the algorithm changes them (``updates_frozen``, FLoRA's merges)."""
    if getattr(module.net, "checkpoint_frozen", True) or getattr(module.algorithm, "updates_frozen", False):
        return []
    return [n for n, p in module.net.named_parameters() if not p.requires_grad]


def _fingerprint(t: Any) -> list[float]:
    t = t.detach().double()
    return [float(t.sum()), float(t.abs().sum())]


def save_entries(module: CheckpointedRun, checkpoint: dict[str, Any]) -> None:
    """``FederatedModule.on_save_checkpoint``: the run's ``fl_*`` entries (and a host or disk bank's journal)."""
    left_out = _frozen_left_out(module)
    if left_out:  # only a fingerprint of each frozen base tensor, to refuse a resume onto another base
        params = dict(module.net.named_parameters())
        checkpoint["fl_frozen"] = {n: _fingerprint(params[n]) for n in left_out}
        for n in left_out:
            checkpoint.get("state_dict", {}).pop(f"net.{n}", None)
    bank = module.bank
    if bank is not None and bank.placement != "device":
        checkpoint["fl_client_state"] = bank.save_journal(journal_directories(module)[0])
    checkpoint["fl_history"] = list(module.history)
    checkpoint["fl_upload_bytes"] = module.upload_bytes
    checkpoint["fl_wall_s"] = module.wall_seconds()
    checkpoint["fl_identity"] = identity(module)
    last = module.rounds_trained - 1
    if module.attached_trainer is not None and module.trainer.state.fn == TrainerFn.FITTING and last >= 0:
        evaluated = module.history[-1]["round"] if module.history else -1
        checkpoint["fl_skips_validation_of"] = last if module.validates_after(last) and evaluated != last else None


def load_entries(module: CheckpointedRun, checkpoint: dict[str, Any]) -> None:
    """``FederatedModule.on_load_checkpoint``: refuse a checkpoint that does not fit, restore the ``fl_*``
    entries, and warn when the checkpoint was written before a validation that the resumed run will skip."""
    restore_frozen(module, checkpoint)
    problem = checkpoint_mismatch(module, checkpoint) if module.bank is not None else None
    if problem:
        raise ConfigError(problem)
    if module.bank is not None:
        load_bank(module, checkpoint)
    module.history = list(checkpoint.get("fl_history", []))
    module.rounds_trained = int(checkpoint.get("global_step", 0))
    module.upload_bytes = float(checkpoint.get("fl_upload_bytes", 0.0))
    module.resumed_wall_s = float(checkpoint.get("fl_wall_s", 0.0))
    skipped = checkpoint.get("fl_skips_validation_of")
    if skipped is not None and module.trainer.state.fn == TrainerFn.FITTING:
        log.warning(
            "this checkpoint was written before the validation of round %d (ModelCheckpoint(every_n_train_steps) "
            "saves before validation); the resumed run does not evaluate that round. "
            "fl_lightning.callbacks.RoundCheckpoint saves after it.",
            skipped,
        )


def load_bank(module: CheckpointedRun, checkpoint: dict[str, Any]) -> None:
    """Restore the client-state bank from either layout (see the module docstring); afterwards ``state_dict``
    holds exactly the ``bank.*`` entries the module's placement loads through Lightning (none off the device)."""
    bank, state = module.bank, checkpoint.setdefault("state_dict", {})
    journal = checkpoint.get("fl_client_state")
    if journal is not None:
        if journal.get("format") != 1:
            raise ConfigError(f"the checkpoint's client state has format {journal.get('format')}; this version reads 1")
        bank.restore_journal(journal, journal_directories(module))
        if bank.placement == "device":
            state.update({f"bank.{k}": v for k, v in bank.state_dict().items()})
    elif bank.placement != "device":
        tables = {k: state.pop(k) for k in list(state) if k.startswith("bank.")}
        if tables:
            bank.load_full(tables)


def restore_frozen(module: CheckpointedRun, checkpoint: dict[str, Any]) -> None:
    """Put back the frozen base tensors a checkpoint left out (``fl_frozen``), from this process's network, after
    checking that they are the ones the run was trained on."""
    frozen = checkpoint.get("fl_frozen")
    if not frozen:
        return
    params, state = dict(module.net.named_parameters()), checkpoint.setdefault("state_dict", {})
    for n, saved in frozen.items():
        if n not in params:
            continue  # checkpoint_mismatch names the missing parameter
        ours = _fingerprint(params[n])
        if any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(ours, saved)):
            raise ConfigError(
                f"the checkpoint was trained on another base model: frozen {n} differs from this config's; "
                "fix: resume with the same model.network.model (or config and seed)"
            )
        state[f"net.{n}"] = params[n].detach()
