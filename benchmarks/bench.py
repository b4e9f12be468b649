"""``make bench``: seconds per FedRep round for the sequential reference and the vectorized fast path.

Everything is measured in the same run, on one CPU thread (``torch.set_num_threads(1)``), and reported as
medians over ``--rounds`` rounds, with the ratio sequential / vectorized. Workloads (issue 8):

* ``pfllib_cnn``: PFLlib's FedAvgCNN on CIFAR-10-shaped random tensors, 100 clients × 500 train / 100 test
  images, 10 clients per round, FedRep with 10 head epochs + 1 body epoch, batch 10, SGD lr 0.01, momentum 0.5;
  fp32 and bf16 autocast;
* ``fedrep_cnn_aug``: the FedRep authors' CNNCifar on the same data with batched crop+flip augmentation;
* ``digits_fedavg``: FedAvg on the digits quickstart split;
* ``scale``: FedRep with personal heads on 100 vs 10,000 clients, 100 sampled per round.

It prints a table and writes ``results.json`` (metrics ``train_s_per_round``, ``eval_s``, ``speedup``,
``peak_rss_mb``, ``client_state_bytes_per_client``) under ``results/bench/``.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time
from pathlib import Path

import torch

from benchmarks import run_axis
from datamodules.augment import CropFlip
from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.client_data import ClientSplit, FederatedData
from fl_lightning.models import CifarCNN, DigitsMLP, FedAvgCNN
from fl_lightning.models.split import SplitModel, mlp_layers
from fl_lightning.module import FederatedModule
from fl_lightning.results import bar_chart, format_table, record, write_results
from fl_lightning.rounds import ClientSampler


def image_data(num_clients: int, train: int, test: int, shape=(3, 32, 32), augment=None, seed=0) -> FederatedData:
    """Random tensors of the real shapes; each client has 2 of 10 classes."""
    g = torch.Generator().manual_seed(seed)

    def split(per_client: int) -> ClientSplit:
        x = torch.randn(num_clients * per_client, *shape, generator=g)
        classes = torch.randint(0, 10, (num_clients, 2), generator=g)
        pick = torch.randint(0, 2, (num_clients, per_client), generator=g)
        y = classes.gather(1, pick).reshape(-1)
        return ClientSplit(x, y, torch.arange(num_clients + 1) * per_client)

    return FederatedData(split(train), split(test), 10, seed=seed, augment=augment)


class TinyMLP(SplitModel):
    def __init__(self, dim: int = 32) -> None:
        from collections import OrderedDict

        from torch import nn

        super().__init__(nn.Sequential(OrderedDict(mlp_layers([dim, 64]))), nn.Linear(64, 10))


def module_for(algorithm, net, fed: FederatedData, executor: str) -> FederatedModule:
    module = FederatedModule(algorithm, net, lr=0.01, momentum=0.5, batch_size=10, executor=executor)
    module.attach_data(fed)
    return module


def time_rounds(module: FederatedModule, clients_per_round: int, rounds: int, bf16: bool) -> list[float]:
    sampler = ClientSampler(module.fed.num_clients, clients_per_round, seed=0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times = []
    for r in range(rounds):
        cohort = sampler.sample(r)
        glob = module.global_params()
        states = [module.bank.get(int(c)) for c in cohort]
        start = time.perf_counter()
        with autocast:
            module.run_clients(cohort.tolist(), r, glob, states, [1.0] * len(cohort))
        times.append(time.perf_counter() - start)
    return times


def time_eval(module: FederatedModule, bf16: bool) -> float:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    start = time.perf_counter()
    with autocast:
        module.evaluate_clients(0)
    return time.perf_counter() - start


def precision_rows(args: argparse.Namespace, records: list) -> None:
    """bf16's accuracy and speed effect on the digits quickstart (FedRep, 100 rounds, vectorized executor)."""
    from fl_lightning.cli import train_config

    rounds = "10" if args.quick else "100"
    for precision in ("32-true", "bf16-mixed"):
        summary = train_config(
            ["configs/quickstart.yaml"],
            [
                "--trainer.max_steps",
                rounds,
                "--trainer.precision",
                precision,
                "--model.executor",
                "vectorized",
                "--trainer.enable_checkpointing",
                "false",
            ],
            run_dir=args.out / f"quickstart_{precision}",
        )
        setting = f"digits_quickstart,rounds={rounds}"
        records.append(record("bench", f"vectorized-{precision}", "acc_last10", summary["last10"], setting=setting))
        records.append(record("bench", f"vectorized-{precision}", "wall_s", summary["wall_s"], setting=setting))
        print(f"  digits quickstart {precision:10s} acc_last10 {summary['last10']:.4f}  wall {summary['wall_s']:.1f} s")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement (median)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["pfllib_cnn", "fedrep_cnn_aug", "digits_fedavg", "scale", "digits_precision", "run_axis"],
        help="which workloads to run",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n_train, n_test, n_clients = (40, 10, 20) if args.quick else (500, 100, 100)
    head_epochs = 2 if args.quick else 10
    records, rows = [], []

    def measure(workload: str, make_net, fed: FederatedData, algorithm, per_round: int, variants) -> None:
        seq_time = None
        for executor, bf16 in variants:
            torch.manual_seed(0)
            module = module_for(algorithm(), make_net(), fed, executor)
            train = statistics.median(time_rounds(module, per_round, args.rounds, bf16))
            evaluation = time_eval(module, bf16)
            name = f"{executor}{'-bf16' if bf16 else ''}"
            if executor == "sequential" and not bf16:
                seq_time = train
            speedup = seq_time / train if seq_time else float("nan")
            rows.append((workload, name, train, evaluation, speedup, peak_rss_mb()))
            setting = f"clients={fed.num_clients},per_round={per_round},threads={args.threads}"
            records.append(record("bench", name, "train_s_per_round", train, setting=f"{workload},{setting}"))
            records.append(record("bench", name, "eval_s", evaluation, setting=f"{workload},{setting}"))
            records.append(record("bench", name, "speedup", speedup, setting=f"{workload},{setting}"))
            records.append(record("bench", name, "peak_rss_mb", peak_rss_mb(), setting=f"{workload},{setting}"))
            print(f"  {workload:15s} {name:18s} train {train:8.3f} s/round  eval {evaluation:7.3f} s  ×{speedup:.2f}")

    all_variants = [("sequential", False), ("vectorized", False), ("sequential", True), ("vectorized", True)]
    if "pfllib_cnn" in args.workloads:
        data = image_data(n_clients, n_train, n_test)
        measure("pfllib_cnn", FedAvgCNN, data, lambda: FedRep(head_epochs, 1), 10, all_variants)
    if "fedrep_cnn_aug" in args.workloads:
        aug = image_data(n_clients, n_train, n_test, augment=CropFlip(4))
        measure("fedrep_cnn_aug", CifarCNN, aug, lambda: FedRep(head_epochs, 1), 10, all_variants[:2])
    if "digits_fedavg" in args.workloads:
        from datamodules import DigitsDataModule

        digits = DigitsDataModule(num_clients=20, participation=0.2, seed=0)
        digits.setup()
        measure("digits_fedavg", DigitsMLP, digits.federated, lambda: FedAvg(1), 4, all_variants[:2])
    if "digits_precision" in args.workloads:
        precision_rows(args, records)
    if "run_axis" in args.workloads:  # batched runs vs one after another: benchmarks/run_axis.py, its own results.json
        run_axis.main(["--out", str(args.out / "run_axis"), *(["--quick"] if args.quick else [])])

    scale_rows = {}
    for total in (100, 2000 if args.quick else 10_000) if "scale" in args.workloads else ():
        fed = image_data(total, 20, 5, shape=(32,), seed=1)
        for executor in ("sequential", "vectorized"):
            torch.manual_seed(0)
            module = module_for(FedRep(head_epochs, 1), TinyMLP(), fed, executor)
            train = statistics.median(time_rounds(module, 100, args.rounds, False))
            scale_rows[(total, executor)] = train
            per_client = module.bank.bytes_per_client()
            setting = f"scale,clients={total},per_round=100"
            records.append(record("bench", executor, "train_s_per_round", train, setting=setting))
            records.append(record("bench", executor, "client_state_bytes_per_client", per_client, setting=setting))
            rows.append((f"scale_{total}", executor, train, float("nan"), float("nan"), peak_rss_mb()))
            print(f"  scale {total:6d} clients {executor:11s} train {train:8.3f} s/round  state {per_client} B/client")

    print()
    print(f"FedRep round times, {args.threads} CPU thread(s), median of {args.rounds} rounds")
    print(format_table(["workload", "executor", "train_s/round", "eval_s", "speedup", "peak_rss_MB"], rows))
    big = max((t for t, _ in scale_rows), default=None)
    for executor in ("sequential", "vectorized") if big else ():
        ratio = scale_rows[(big, executor)] / scale_rows[(100, executor)]
        print(f"scale ({executor}): {big} clients / 100 clients round time = {ratio:.2f}×")
        records.append(record("bench", executor, "scale_ratio", ratio, setting=f"{big}_vs_100_clients"))
    labels = [f"{w}\n{e}" for w, e, *_ in rows if not w.startswith("scale")]
    values = [t for w, _, t, *_ in rows if not w.startswith("scale")]
    args.out.mkdir(parents=True, exist_ok=True)
    bar_chart(args.out / "round_times.png", labels, values, "training seconds per round", "FedRep round time")
    path = write_results(records, args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
