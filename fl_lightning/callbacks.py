"""RoundCheckpoint: Lightning's ModelCheckpoint, every N rounds, written after the round's validation.

A plain ``ModelCheckpoint(every_n_train_steps=N)`` saves in ``on_train_batch_end``, before the validation
of that round; a run resumed from it never evaluates that round (Lightning skips the validation it finds
"already due"), so its history, EarlyStopping state and ``last10`` differ from an uninterrupted run.
``RoundCheckpoint`` defers the save of a round that is evaluated to the end of its validation; the other
rounds are saved in ``on_train_batch_end`` as usual. ``save_last`` also covers the final round.

A round that writes its round checkpoint serialises once: ``last.ckpt`` becomes a hard link to the round's file
(written with ``last_model_path`` already set, so it holds what a second ``torch.save`` of ``last.ckpt`` would), put
in place by an atomic rename; it stays a regular file when the round file is later rotated out. Where the folder
cannot hold hard links, ``last.ckpt`` is written in full as before.

Before each save it checks the free space of the checkpoint folder: a disk too full for the next checkpoint stops
the run with one line (how many bytes it needs) and leaves the previous checkpoints untouched, instead of a
truncated ``last.ckpt`` and a traceback. The bytes it needs are the size of the checkpoint this callback wrote last
(the folder is searched only before its first save).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
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


def newest_checkpoint(folder: Path, other_than: str) -> Path | None:
    """The most recently written ``*.ckpt`` of ``folder`` but ``other_than``, or None."""
    existing = [p for p in folder.glob("*.ckpt") if p.is_file() and p != Path(other_than)]
    return max(existing, key=lambda p: p.stat().st_mtime_ns) if existing else None


def hard_link(source: str, target: str) -> bool:
    """``target`` becomes a hard link to ``source`` (a new name put in place by one atomic rename); False where the
    file system has no hard links (``target`` is then left as it was)."""
    staged = f"{target}.link"
    try:
        if os.path.lexists(staged):
            os.remove(staged)
        os.link(source, staged)
    except OSError:
        return False
    os.replace(staged, target)
    return True


class RoundCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for federated rounds: ``every_n_train_steps`` counts rounds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written_bytes: int | None = None  # the size of the last checkpoint this callback wrote
        self._planned_last: tuple[str, str, str] | None = None  # (round file, last.ckpt, the last path before)

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
        the tensors of the first one, plus 5 %). A round file that ``last.ckpt`` will link to is written with
        ``last_model_path`` set to ``last.ckpt`` (``_plan_last``)."""
        self._plan_last(trainer, filepath)
        if trainer.is_global_zero:
            folder = Path(filepath).parent
            if self._written_bytes is None:
                folder.mkdir(parents=True, exist_ok=True)
                previous = newest_checkpoint(folder, filepath)
                needed = (
                    previous.stat().st_size
                    if previous is not None
                    else tensor_bytes(trainer._checkpoint_connector.dump_checkpoint(self.save_weights_only))
                )
            else:
                needed = self._written_bytes
            needed = int(needed * 1.05) + 4096
            if shutil.disk_usage(folder).free < needed:
                raise disk_full(folder, needed, filepath, newest_checkpoint(folder, filepath))
            if os.path.isfile(filepath) and os.stat(filepath).st_nlink > 1:
                # ``last.ckpt`` linked to a round file: Lightning's checkpoint IO replaces the file (a new inode), but
                # one that writes in place would change the round file through the link
                os.remove(filepath)
            try:
                super()._save_checkpoint(trainer, filepath)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if os.path.isfile(filepath):
                    os.remove(filepath)  # a truncated file would be taken for a checkpoint
                raise disk_full(folder, needed, filepath, newest_checkpoint(folder, filepath)) from None
            self._written_bytes = os.path.getsize(filepath)
            return
        super()._save_checkpoint(trainer, filepath)

    def _plan_last(self, trainer: Any, filepath: str) -> None:
        """Before a round file is serialised: if ``last.ckpt`` can be a link to it, set ``last_model_path`` now (it
        is part of the saved state) and remember the link to make (``_save_last_checkpoint``)."""
        self._planned_last = None
        if (
            filepath == self.last_model_path  # the full save of ``last`` itself
            or self.save_last is not True
            or self.save_top_k == 0
            or "{" in self.CHECKPOINT_NAME_LAST
            or not _is_local_file_protocol(str(self.dirpath or ""))
        ):
            return
        last = self._last_path(trainer)
        if os.path.abspath(last) == os.path.abspath(filepath):
            return
        self._planned_last = (filepath, last, self.last_model_path)
        self.last_model_path = last

    def _last_path(self, trainer: Any) -> str:
        """Where ``_save_last_checkpoint`` would write ``last``: Lightning's name and version counter."""
        filepath = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)
        if self._enable_version_counter:
            version = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST, ver=version)
                version += 1
        return filepath

    def _save_last_checkpoint(self, trainer: Any, monitor_candidates: dict[str, Any]) -> None:
        """``last.ckpt`` as a hard link to the round file just written (``_plan_last``), else Lightning's full save."""
        planned, self._planned_last = self._planned_last, None
        if planned is None:
            return super()._save_last_checkpoint(trainer, monitor_candidates)
        source, last, previous = planned
        if source != self._last_checkpoint_saved or self._last_global_step_saved != trainer.global_step:
            self.last_model_path = previous
            return super()._save_last_checkpoint(trainer, monitor_candidates)
        linked = True
        if trainer.is_global_zero:
            linked = hard_link(source, last)
        if not trainer.strategy.reduce_boolean_decision(linked, all=True):
            self.last_model_path = previous  # a folder without hard links: written in full
            return super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_checkpoint_saved = last
        if trainer.is_global_zero:
            from weakref import proxy

            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
        if previous and self._should_remove_checkpoint(trainer, previous, last):
            self._remove_checkpoint(trainer, previous)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """``last`` is the final round, also when the run length is not a multiple of ``every_n_train_steps``."""
        if self.save_last and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
