"""Run a few short federated fits with N CPU processes and save what rank 0 ends with (used by test_distributed).

usage: python tests/helpers/ddp_script.py DEVICES OUT.pt [TRAIN.json]

TRAIN.json (optional) maps names to ``train.py`` argument lists (each with its own ``--run_dir``): after the fits
above, each runs through ``cli.main`` (what train.py calls) on the same DEVICES, in the same launch (the launcher
starts the other ranks once per process, not once per fit).

Besides each run's history, model and client bank it records what crossed between the processes: the tensors
DDP broadcast (by storage), the size of each round's sum-all-reduce and of the state rows each rank sent.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fl_lightning.engine.stacked as executors  # noqa: E402
from datamodules import DigitsDataModule, Dirichlet, Shards  # noqa: E402
from datamodules.augment import CropFlip  # noqa: E402
from fl_lightning import algorithms  # noqa: E402
from fl_lightning.engine.module import FederatedModule  # noqa: E402
from fl_lightning.models import DigitsCNN, DigitsMLP  # noqa: E402

BROADCAST: list[int] = []  # storages of every tensor DDP broadcast (initial sync and per-forward buffer sync)


def _record(original):
    def broadcast(group, tensors, *args, **kwargs):
        BROADCAST.extend(t.untyped_storage().data_ptr() for t in tensors)
        return original(group, tensors, *args, **kwargs)

    return broadcast


torch.distributed._broadcast_coalesced = _record(torch.distributed._broadcast_coalesced)  # what DDP calls


class AugmentedDigits(DigitsDataModule):
    def setup(self, stage=None):
        super().setup(stage)
        self.federated.augment = CropFlip(1)


#: name -> (algorithm, network, executor, data, conv policy on the CPU)
RUNS = {
    "fedavg": (lambda: algorithms.FedAvg(1), DigitsMLP, "sequential", "shards", "loop"),
    "fedrep": (lambda: algorithms.FedRep(2, 1), DigitsMLP, "sequential", "shards", "loop"),
    "lg_fedavg": (lambda: algorithms.LGFedAvg(1, personal=("body.fc1",)), DigitsMLP, "sequential", "shards", "loop"),
    # issue 16: the vectorized executor, unequal clients (ranks balanced by samples), a conv net with crop+flip
    "scaffold_vectorized": (lambda: algorithms.SCAFFOLD(), DigitsMLP, "vectorized", "dirichlet", "loop"),
    "fedrep_cnn_augment": (lambda: algorithms.FedRep(2, 1), DigitsCNN, "vectorized", "augment", "loop"),
    "ditto_cnn_augment_vmap": (lambda: algorithms.Ditto(), DigitsCNN, "vectorized", "augment", "vmap"),
    # issue 17: per-client BatchNorm layers and statistics (float and integer buffers), FedALA's local model, weights
    # and counter, FedRoD's personal head
    "fedbn": (lambda: algorithms.FedBN(), lambda: DigitsCNN(batchnorm=True), "sequential", "shards", "loop"),
    "fedala": (lambda: algorithms.FedALA(), DigitsMLP, "sequential", "shards", "loop"),
    "fedrod": (lambda: algorithms.FedRoD(), DigitsMLP, "sequential", "shards", "loop"),
}


def datamodule(kind: str) -> DigitsDataModule:
    if kind == "dirichlet":
        return DigitsDataModule(num_clients=20, partition=Dirichlet(0.3), clients_per_round=5, seed=0)
    cls = AugmentedDigits if kind == "augment" else DigitsDataModule
    return cls(num_clients=20, partition=Shards(2), clients_per_round=5, seed=0)


def watch(strategy) -> tuple[list[int], list[tuple[int, ...]]]:
    """Record the size of every sum-all-reduce and the shape of every all-gather the strategy performs."""
    reduced, gathered = [], []
    reduce, all_gather = strategy.reduce, strategy.all_gather

    def counted_reduce(t, *args, **kwargs):
        reduced.append(t.numel())
        return reduce(t, *args, **kwargs)

    def counted_gather(t, *args, **kwargs):
        gathered.append(tuple(t.shape))
        return all_gather(t, *args, **kwargs)

    strategy.reduce, strategy.all_gather = counted_reduce, counted_gather
    return reduced, gathered


def train_runs(devices: int, spec_path: str) -> None:
    """Each ``train.py`` argument list of the JSON file through ``cli.main`` on ``devices`` CPU processes."""
    import json

    from fl_lightning.cli import main as cli_main

    strategy = ["--trainer.strategy", "ddp"] if devices > 1 else []
    for args in json.loads(open(spec_path).read()).values():
        code = cli_main([*args, "--trainer.accelerator", "cpu", "--trainer.devices", str(devices), *strategy,
                         "--trainer.enable_progress_bar", "false"])  # fmt: skip
        if code != 0:
            raise SystemExit(f"train.py {' '.join(args)} exited with {code}")


def main(devices: int, out_path: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for name, (make, network, executor, data, conv) in RUNS.items():
        executors.CONV_CLIENTS["cpu"] = conv
        L.seed_everything(0, verbose=False)
        module = FederatedModule(make(), network(), eval_every=1, batch_size=10, executor=executor)
        dm = datamodule(data)
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
        reduced, gathered = watch(trainer.strategy)
        BROADCAST.clear()
        trainer.fit(module, datamodule=dm)
        bank = {n: module.bank.row(n) for n in module.bank.names}
        results[name] = {
            "history": module.history,
            "params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
            "bank": {n: v.clone() for n, v in bank.items()},
            "world": trainer.world_size,
            "bank_broadcast": any(v.untyped_storage().data_ptr() in BROADCAST for v in bank.values()),
            "broadcast": len(BROADCAST),
            "reduced": reduced,
            "gathered": gathered,
            "upload_numel": sum(t.numel() for t in module.algorithm.upload_template(module.global_params()).values()),
        }
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
    if len(sys.argv) > 3:
        train_runs(int(sys.argv[1]), sys.argv[3])
