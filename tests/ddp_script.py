"""Run a few short federated fits with N CPU processes and save what rank 0 ends with (used by test_distributed).

usage: python tests/ddp_script.py DEVICES OUT.pt
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from datamodules import DigitsDataModule, Shards  # noqa: E402
from fl_lightning import algorithms  # noqa: E402
from fl_lightning.models import DigitsCNN, DigitsMLP  # noqa: E402
from fl_lightning.module import FederatedModule  # noqa: E402


def candidates() -> dict[str, algorithms.Algorithm]:
    out = {
        "fedavg": algorithms.FedAvg(1),
        "fedrep": algorithms.FedRep(2, 1),
        "lg_fedavg": algorithms.LGFedAvg(1, personal=("body.fc1",)),
    }
    for name, make in {"scaffold": "SCAFFOLD", "ditto": "Ditto"}.items():  # client state beyond heads, if present
        if hasattr(algorithms, make):
            out[name] = getattr(algorithms, make)()
    # issue 17: per-client BatchNorm layers and statistics (float and integer buffers), FedALA's local model, weights
    # and counter, FedRoD's personal head
    out.update(fedbn=algorithms.FedBN(), fedala=algorithms.FedALA(), fedrod=algorithms.FedRoD())
    return out


NETWORKS = {"fedbn": lambda: DigitsCNN(batchnorm=True)}  # the others train DigitsMLP


def main(devices: int, out_path: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, algorithm in candidates().items():
        L.seed_everything(0, verbose=False)
        module = FederatedModule(algorithm, NETWORKS.get(name, DigitsMLP)(), eval_every=1, batch_size=10)
        dm = DigitsDataModule(num_clients=20, partition=Shards(2), clients_per_round=5, seed=0)
        trainer = L.Trainer(
            max_steps=3,
            accelerator="cpu",
            devices=devices,
            strategy="ddp" if devices > 1 else "auto",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            num_sanity_val_steps=0,
        )
        trainer.fit(module, datamodule=dm)
        results[name] = {
            "history": module.history,
            "params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
            "bank": {n: module.bank.row(n).clone() for n in module.bank.names},
            "world": trainer.world_size,
        }
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
