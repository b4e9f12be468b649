"""A short DP-FedAvg fit with N CPU processes; rank 0 saves the model, the adaptive clip and ε
(used by tests/engine/test_privacy.py: 2 processes = 1 with ``model.privacy`` on).

usage: python tests/engine/dp_ddp_script.py DEVICES OUT.pt
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fl_lightning import algorithms  # noqa: E402
from fl_lightning.engine.module import FederatedModule  # noqa: E402
from fl_lightning.engine.privacy import AdaptiveClip, Privacy  # noqa: E402
from fl_lightning.models import DigitsMLP  # noqa: E402
from tests.helpers.digits_runs import digits  # noqa: E402


def main(devices: int, out_path: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    privacy = Privacy(clip=0.3, noise_multiplier=0.7, adaptive_clip=AdaptiveClip(count_noise_multiplier=0.5))
    module = FederatedModule(algorithms.FedRep(2, 1), DigitsMLP(), aggregation="uniform", batch_size=10,
                             eval_every=100, eval_last=0, executor="sequential", privacy=privacy)  # fmt: skip
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, datamodule=digits(clients_per_round=5))
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
                    "clip": float(module.privacy.clip_value), "epsilon": module.privacy.epsilon(3),
                    "world": trainer.world_size}, out_path)  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
