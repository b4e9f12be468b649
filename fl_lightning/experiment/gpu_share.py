"""``--jobs auto``: as many jobs at once on the GPU(s) as their memory holds, decided from memory a job measured.

The experiment runner starts one job (one run, or one batched job of the run axis) as a worker process. When it
finishes, its ``summary.json`` holds ``peak_device_mb``, the CUDA allocator's peak of that process (every run of a
batched job reports the same process). The other jobs then run ``MEMORY_FRACTION`` × the card's memory / that peak
at a time per GPU (worker ``k`` sees GPU ``k mod #GPUs``), at least 1 and at most one per CPU core. The grid's jobs
are alike (one experiment file: the same network and data, other seeds or hyper-parameters), so the first one's
peak stands for the others; a job larger than the first could still run out of memory. Without CUDA, ``auto`` runs
one job at a time in this process, as ``--jobs 1`` does.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MEMORY_FRACTION", "JobLimit", "jobs_that_fit", "measured_peak_mb"]

#: the share of each card's memory that concurrent jobs may fill (the rest: CUDA contexts, fragmentation)
MEMORY_FRACTION = 0.9


def jobs_that_fit(card_mb: float, peak_mb: float, gpus: int, most: int) -> int:
    """``gpus`` × ⌊``MEMORY_FRACTION`` · ``card_mb`` / ``peak_mb``⌋ jobs, clamped to ``[1, most]``."""
    per_card = math.floor(MEMORY_FRACTION * card_mb / peak_mb) if peak_mb > 0 else most
    return max(1, min(most, per_card * max(gpus, 1)))


def measured_peak_mb(run_dirs: Sequence[Path]) -> float | None:
    """The largest ``peak_device_mb`` in the ``summary.json`` of ``run_dirs`` (None: none recorded one)."""
    peaks = []
    for run_dir in run_dirs:
        path = Path(run_dir) / "summary.json"
        if path.is_file():
            value = json.loads(path.read_text()).get("peak_device_mb")
            if isinstance(value, (int, float)):
                peaks.append(float(value))
    return max(peaks) if peaks else None


def card_memory_mb() -> tuple[float, int]:
    """(memory of GPU 0 in MiB, number of GPUs), or (0, 0) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0.0, 0
    return torch.cuda.get_device_properties(0).total_memory / 2**20, torch.cuda.device_count()


class JobLimit:
    """How many jobs run at once: a number (``--jobs N``) or ``auto`` (one job, then as many as fit)."""

    def __init__(self, jobs: int | str) -> None:
        self.auto = jobs == "auto"
        self.card_mb, self.gpus = card_memory_mb() if self.auto else (0.0, 0)
        self.most = (os.cpu_count() or 1) if self.auto and self.gpus else (1 if self.auto else int(jobs))
        self.limit = 1 if self.auto else self.most
        self.decided = not (self.auto and self.gpus)

    @property
    def in_process(self) -> bool:
        """One job at a time in this process (``--jobs 1``, or ``auto`` without CUDA)."""
        return self.most <= 1

    def learn(self, run_dirs: Sequence[Path]) -> str | None:
        """After a job has finished: with ``auto``, the limit from its measured peak, and the line that says it
        (once); otherwise None."""
        if self.decided:
            return None
        peak = measured_peak_mb(run_dirs)
        if peak is None:  # it failed before its summary: the next job measures
            return None
        self.decided = True
        self.limit = jobs_that_fit(self.card_mb, peak, self.gpus, self.most)
        return (f"[jobs] {self.limit} at once: a job peaked at {peak:.0f} MiB of the GPU's {self.card_mb:.0f} MiB "
                f"({self.gpus} GPU(s), {MEMORY_FRACTION:.0%} of each, at most {self.most})")  # fmt: skip
