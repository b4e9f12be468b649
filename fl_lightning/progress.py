"""A progress bar that counts communication rounds (Lightning's says "Epoch 0" for a whole run)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar


class RoundProgressBar(TQDMProgressBar):
    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.initial = trainer.global_step  # a resumed run starts where it stopped
        self.train_progress_bar.set_description("rounds")

    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics
