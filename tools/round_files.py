"""Which files of ``fl_lightning/`` one communication round runs, and which of their functions: a FedRep round on the
sequential path (digits, 10 clients, 3 per round), traced with ``sys.setprofile`` over the second round's
``training_step`` (the first one also builds caches), from sampling to the server step; the files only the round's
logging after the server step touches (``_log_round``, ``step_schedules``) are listed apart.

    python tools/round_files.py

Prints one line per file (``path: function, …``) and the counts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fl_lightning"
#: the module's steps after the server step (logging, the next round's schedules)
AFTER_THE_SERVER_STEP = ("_log_round", "step_schedules")


def trace_round() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(files and functions from the round's start to its server step, those only the steps after it reach)."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("WANDB_MODE", "disabled")
    import lightning as L

    from datamodules import DigitsDataModule, Shards
    from fl_lightning.algorithms import FedRep
    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import DigitsMLP

    before: dict[str, set[str]] = {}
    after: dict[str, set[str]] = {}
    depth = {"after": 0}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_name
        if event == "call" and name in AFTER_THE_SERVER_STEP:
            depth["after"] += 1
        elif event == "return" and name in AFTER_THE_SERVER_STEP:
            depth["after"] -= 1
        if event == "call":
            path = Path(frame.f_code.co_filename).resolve()
            if PACKAGE in path.parents:
                target = after if depth["after"] else before
                target.setdefault(str(path.relative_to(ROOT)), set()).add(name)

    class Traced(FederatedModule):
        rounds_seen = 0

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.rounds_seen += 1
            if self.rounds_seen != 2:
                return super().training_step(batch, batch_idx)
            sys.setprofile(profile)
            try:
                return super().training_step(batch, batch_idx)
            finally:
                sys.setprofile(None)

    L.seed_everything(0, verbose=False)
    module = Traced(FedRep(head_epochs=1, body_epochs=1), DigitsMLP(), executor="sequential", eval_every=100)
    data = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
                        limit_val_batches=0)  # fmt: skip
    trainer.fit(module, datamodule=data)
    return before, {f: names for f, names in after.items() if f not in before}


def main() -> None:
    before, after = trace_round()
    for file, names in sorted(before.items()):
        print(f"{file}: {', '.join(sorted(names))}")
    print(f"{len(before)} files from training_step to the server step")
    for file, names in sorted(after.items()):
        print(f"after the server step only: {file}: {', '.join(sorted(names))}")


if __name__ == "__main__":
    main()
