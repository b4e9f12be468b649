"""Shared by the run axis' tests: a short quickstart run, a callback that crashes at a given round, and the check that a
batched run is the run alone (history, final parameters and bank, summary)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from tests.helpers.asserts import assert_close_finite

ROOT = Path(__file__).resolve().parents[2]


QUICK = [
    "--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.max_steps", "4", "--checkpoint_every", "2",
    "--model.algorithm.init_args.head_epochs", "2", "--trainer.enable_progress_bar", "false",
]  # fmt: skip


class CrashAt(Callback):
    """Raises at the start of round ``round`` (a crash after the checkpoint of the rounds before)."""

    def __init__(self, round: int) -> None:
        self.round = round

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.round:
            raise RuntimeError(f"crash at round {self.round}")


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def assert_same_run(batched: Path, solo: Path) -> None:
    """Same evaluation history (every metric of every evaluated round) and same final parameters and bank."""
    hb, hs = json.loads((batched / "history.json").read_text()), json.loads((solo / "history.json").read_text())
    assert [h["round"] for h in hb] == [h["round"] for h in hs] and len(hs) >= 3
    for key in ("val/acc_mean", "val/acc_weighted", "val/loss"):
        assert_close_finite([h[key] for h in hb], [h[key] for h in hs], rtol=0, atol=1e-5, msg=key)
    sb, ss = final_state(batched), final_state(solo)
    assert set(sb) == set(ss)
    for name in ss:
        if ss[name].is_floating_point():
            assert_close_finite(sb[name], ss[name], rtol=0, atol=1e-5, msg=name)
    sum_b, sum_s = json.loads((batched / "summary.json").read_text()), json.loads((solo / "summary.json").read_text())
    assert sum_b["rounds"] == sum_s["rounds"] == 4
    assert abs(sum_b["final"] - sum_s["final"]) < 1e-5 and abs(sum_b["last10"] - sum_s["last10"]) < 1e-5
