"""RoundCheckpoint: Lightning's ModelCheckpoint, every N rounds, written after the round's validation.

A plain ``ModelCheckpoint(every_n_train_steps=N)`` saves in ``on_train_batch_end``, before the validation
of that round; a run resumed from it never evaluates that round (Lightning skips the validation it finds
"already due"), so its history, EarlyStopping state and ``last10`` differ from an uninterrupted run.
``RoundCheckpoint`` defers the save of a round that is evaluated to the end of its validation; the other
rounds are saved in ``on_train_batch_end`` as usual. ``save_last`` also covers the final round.

Before each save it checks the free space of the checkpoint folder: a disk too full for the next checkpoint stops
the run with one line (how many bytes it needs) and leaves the previous checkpoints untouched, instead of a
truncated ``last.ckpt`` and a traceback.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from fl_lightning.errors import ConfigError


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside nested dicts, lists and tuples (what ``torch.save`` mostly writes)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def disk_full(folder: Path, needed: int, filepath: str, previous: Path | None) -> ConfigError:
    free = shutil.disk_usage(folder).free
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint was written"
    return ConfigError(
        f"disk full: the checkpoint {filepath} needs about {needed:,} bytes, {free:,} are free in {folder}; {kept}; "
        "fix: free space (or pick a --run_dir on another disk) and resume with --ckpt_path last"
    )


class RoundCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for federated rounds: ``every_n_train_steps`` counts rounds."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        every = self._every_n_train_steps
        if every < 1 or trainer.global_step % every or self._should_skip_saving_checkpoint(trainer):
            return
        if pl_module.validates_after(trainer.global_step - 1):
            self._defer_save_until_validation = True  # ModelCheckpoint.on_validation_end saves it
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Lightning's, only where it can save: a deferred round save, an epoch trigger, the last checkpoint of a
        round just saved, or a ``"link"``. On the other rounds its only work was a deep copy of every logged metric
        (``_monitor_candidates``), every round."""
        if (
            self._defer_save_until_validation
            or self._every_n_epochs >= 1
            or self._last_global_step_saved == trainer.global_step
            or (self.save_last == "link" and self._last_checkpoint_saved)
        ):
            super().on_validation_end(trainer, pl_module)

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        """Lightning's save, after checking that the folder has room for it (the size of the newest checkpoint, or
        the tensors of the first one, plus 5 %)."""
        if trainer.is_global_zero:
            folder = Path(filepath).parent
            folder.mkdir(parents=True, exist_ok=True)
            existing = [p for p in folder.glob("*.ckpt") if p.is_file() and p != Path(filepath)]
            previous = max(existing, key=lambda p: p.stat().st_mtime_ns) if existing else None
            if previous is not None:
                needed = previous.stat().st_size
            else:
                needed = tensor_bytes(trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only))
            needed = int(needed * 1.05) + 4096
            if shutil.disk_usage(folder).free < needed:
                raise disk_full(folder, needed, filepath, previous)
            try:
                super()._save_checkpoint(trainer, filepath)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if os.path.isfile(filepath):
                    os.remove(filepath)  # a truncated file would be taken for a checkpoint
                raise disk_full(folder, needed, filepath, previous) from None
            return
        super()._save_checkpoint(trainer, filepath)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """``last`` is the final round, also when the run length is not a multiple of ``every_n_train_steps``."""
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
