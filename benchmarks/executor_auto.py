"""The measurement behind ``model.executor: auto``'s rule (``fl_lightning.engine.executor.auto_rule``:
``MIN_STACKED_CLIENTS``; with ``--l2gd`` ``MIN_TRAINING_RATE``; with ``--conv`` ``MIN_CONV_MINIBATCHES``).

CPU seconds (``time.process_time``) per round of client work (``FederatedModule.run_clients``), the sequential
loop and the stacked path taking turns round by round on the same cohorts, median over ``--rounds`` rounds after
one warm-up round, one thread; then one all-client evaluation per path. Workloads: the digits quickstart split
(20 clients, about 72 training samples each) with FedRep 10+1 epochs and FedAvg 1 epoch at 1, 2 and 4 clients per
round, and tiny synthetic clients (64 features, 10 samples each; the evaluation column of the last two rows
evaluates a federation of 1 and 2 clients). The ratio sequential / stacked above 1 means the stacked path wins.

``--l2gd``: instead, the rule's training rate (``Algorithm.local_training_rate``): FedAvgCNN on CIFAR-shaped random
data (10 clients × 40 images, all 10 per round, uniform aggregation), FedAvg and L2GD with p = 0.1, 0.5 and 0.9
(clients train in a round with probability 1 − p; α scaled so that the mixing ηλ stays 0.25), the mean over
``--rounds`` rounds (a round trains or only mixes, by the method's coin).

``--conv``: instead, the rule's minibatches per local epoch where convolutional clients run in turn on the stacked
path (``stacked_paths.conv_in_turn``, the CPU): FedAvgCNN on CIFAR-shaped random data (20 clients, 10 per round,
batch 10) with 10, 20, 30 and 40 images per client (1 to 4 minibatches), for ``--methods`` (default LocalOnly,
LGFedAvg, FedDyn, SCAFFOLD, FedProto and FedRep 2+1), the median over ``--rounds`` rounds.

``--temporaries``: what a cohort-size temporary costs the stacked path (the cause of FedDyn's slower stacked round
in ``make bench``'s quick ``methods_cnn`` table before its state update reused Δθ_i): CPU ms of ``a − b`` for
FedAvgCNN's fc weight stacked over 10 clients ([10, 512, 1600], 33 MB) into a fresh tensor and into a preallocated
one, and the same arithmetic as 10 client-size subtractions (the loop's).

    OMP_NUM_THREADS=1 python -m benchmarks.executor_auto [--l2gd | --conv | --temporaries]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fl_lightning.algorithms import Algorithm, FedAvg, FedRep
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import DigitsMLP


def synthetic(num_clients: int, per_client: int, seed: int = 0, shape: tuple[int, ...] = (64,)) -> FederatedData:
    g = torch.Generator().manual_seed(seed)

    def split(k: int) -> ClientSplit:
        x = torch.randn(num_clients * k, *shape, generator=g)
        return ClientSplit(x, torch.randint(0, 10, (num_clients * k,), generator=g), torch.arange(num_clients + 1) * k)

    return FederatedData(split(per_client), split(max(per_client // 4, 1)), 10, seed=seed)


def digits() -> FederatedData:
    from datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0)
    dm.setup()
    return dm.federated


def measure(
    fed: FederatedData, algorithm: Callable[[], Algorithm], per_round: int, rounds: int,
    network: Callable[[], torch.nn.Module] = DigitsMLP, statistic: Callable = statistics.median, **module_args: Any,
) -> dict[str, float]:  # fmt: skip
    """CPU seconds per round of each path (``statistic`` over the rounds: the median, or the mean where rounds
    differ by design) and of one all-client evaluation."""
    modules = {}
    for executor in ("sequential", "vectorized"):
        torch.manual_seed(0)
        module = FederatedModule(algorithm(), network(), lr=0.01, momentum=0.5, batch_size=10, executor=executor,
                                 **module_args)
        module.attach_data(fed)
        modules[executor] = module
    sampler = ClientSampler(fed.num_clients, per_round, seed=0)
    spent: dict[str, list[float]] = {name: [] for name in modules}
    for r in range(rounds + 1):
        cohort = sampler.sample(r).tolist()
        for name, module in modules.items():
            glob, states = module.global_params(), [module.bank.get(c) for c in cohort]
            start = time.process_time()
            module.run_clients(cohort, r, glob, states, [1.0] * per_round)
            if r:  # round 0 warms up
                spent[name].append(time.process_time() - start)
    out = {name: statistic(times) for name, times in spent.items()}
    for name, module in modules.items():
        start = time.process_time()
        module.evaluate_clients(0)
        out[f"eval {name}"] = time.process_time() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--l2gd", action="store_true", help="the training-rate rows (MIN_TRAINING_RATE)")
    parser.add_argument("--conv", action="store_true", help="the conv-in-turn rows (MIN_CONV_MINIBATCHES)")
    parser.add_argument("--methods", nargs="+", default=list(CONV_METHODS), help="--conv: these methods")
    parser.add_argument("--samples", nargs="+", type=int, default=[10, 20, 30, 40], help="--conv: images per client")
    parser.add_argument("--temporaries", action="store_true", help="a cohort-size temporary, fresh vs preallocated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.temporaries:
        spent = temporaries(repeats=20)
        print("  ".join(f"{name} {1e3 * t:.2f} ms" for name, t in spent.items()))
        return
    if args.l2gd:
        training_rate(args.rounds)
        return
    if args.conv:
        conv_minibatches(args.rounds, args.methods, args.samples)
        return
    quick, tiny = digits(), synthetic(20, 10)
    rows = [
        ("quickstart digits, FedRep 10+1", quick, lambda: FedRep(10, 1), 4),
        *[("digits, FedAvg 1 epoch", quick, lambda: FedAvg(1), k) for k in (1, 2, 4)],
        *[("tiny (10 samples/client), FedAvg 1 epoch", tiny, lambda: FedAvg(1), k) for k in (1, 2, 4, 10)],
        *[(f"tiny federation of {n}, FedRep 2+1", synthetic(n, 10), lambda: FedRep(2, 1), n) for n in (1, 2)],
    ]
    print(f"{'workload':42s} {'clients':>7s} {'seq ms':>8s} {'stacked ms':>10s} {'ratio':>6s} {'eval ratio':>10s}")
    for name, fed, algorithm, k in rows:
        t = measure(fed, algorithm, k, args.rounds)
        ratio = t["sequential"] / t["vectorized"]
        eval_ratio = t["eval sequential"] / t["eval vectorized"]
        print(
            f"{name:42s} {k:7d} {1e3 * t['sequential']:8.2f} {1e3 * t['vectorized']:10.2f} {ratio:6.2f} "
            f"{eval_ratio:10.2f}",
            flush=True,
        )


def temporaries(shape: tuple[int, ...] = (10, 512, 1600), repeats: int = 20) -> dict[str, float]:
    """CPU seconds (``time.thread_time``, mean over ``repeats``) of ``a − b`` for a stacked ``shape`` (clients first)
    into a fresh tensor (``fresh``) and into a preallocated one (``preallocated``), and as one subtraction per client
    row (``per client``)."""
    a = torch.randn(shape)
    b = torch.randn(shape[1:]).expand(shape)
    out = torch.empty(shape)
    rows = [a[k] for k in range(shape[0])]

    def mean_time(fn: Callable[[], object]) -> float:
        start = time.thread_time()
        for _ in range(repeats):
            fn()
        return (time.thread_time() - start) / repeats

    return {
        "fresh": mean_time(lambda: a - b),
        "preallocated": mean_time(lambda: torch.sub(a, b, out=out)),
        "per client": mean_time(lambda: [r - b[0] for r in rows]),
    }


#: ``--conv``'s default methods (FedRep with 2 head epochs: its head phase trains on cached features)
CONV_METHODS: dict[str, Callable[[], Algorithm]] = {
    "LocalOnly": lambda: _algorithm("LocalOnly"),
    "LGFedAvg": lambda: _algorithm("LGFedAvg"),
    "FedDyn": lambda: _algorithm("FedDyn"),
    "SCAFFOLD": lambda: _algorithm("SCAFFOLD"),
    "FedProto": lambda: _algorithm("FedProto"),
    "FedRep": lambda: FedRep(2, 1),
}


def _algorithm(name: str) -> Algorithm:
    import fl_lightning.algorithms as algorithms

    return getattr(algorithms, name)()


def conv_minibatches(rounds: int, methods: list[str], samples: list[int]) -> None:
    """The ``--conv`` rows: sequential / stacked against the clients' minibatches per local epoch (batch 10)."""
    from fl_lightning.engine.executor import minibatches_per_epoch
    from fl_lightning.models import FedAvgCNN

    print(f"{'method (FedAvgCNN, 10 of 20 clients)':38s} {'batches':>7s} {'seq ms':>8s} {'stacked ms':>10s} "
          f"{'ratio':>6s}")  # fmt: skip
    for n in samples:
        fed = synthetic(20, n, shape=(3, 32, 32))
        for name in methods:
            make = CONV_METHODS.get(name) or (lambda name=name: _algorithm(name))
            aggregation = "uniform" if make().needs_uniform_aggregation else "num_samples"  # FedDyn's exact mean
            t = measure(fed, make, 10, rounds, FedAvgCNN, aggregation=aggregation)
            batches = minibatches_per_epoch(fed.train.offsets, 10)  # what auto_rule reads
            print(f"{name:38s} {batches:7.3g} {1e3 * t['sequential']:8.1f} {1e3 * t['vectorized']:10.1f} "
                  f"{t['sequential'] / t['vectorized']:6.2f}", flush=True)  # fmt: skip


def training_rate(rounds: int) -> None:
    """The ``--l2gd`` rows: sequential / stacked against the fraction of rounds in which the clients train."""
    from fl_lightning.algorithms import L2GD
    from fl_lightning.models import FedAvgCNN

    fed = synthetic(10, 40, shape=(3, 32, 32))
    rows: list[tuple[str, Callable[[], Algorithm]]] = [("FedAvg 1 epoch", lambda: FedAvg(1))]
    # ηλ = αλ / (N(1 − p)) with N = 10 clients: α = 2.5(1 − p) keeps the mixing at 0.25 for every p
    rows += [(f"L2GD p={p}", lambda p=p: L2GD(p=p, alpha=2.5 * (1 - p))) for p in (0.1, 0.5, 0.9)]
    print(f"{'workload (FedAvgCNN, 10 clients)':34s} {'rate':>5s} {'seq ms':>8s} {'stacked ms':>10s} {'ratio':>6s}")
    for name, algorithm in rows:
        t = measure(fed, algorithm, 10, rounds, FedAvgCNN, statistics.mean, aggregation="uniform")
        rate = algorithm().local_training_rate
        print(f"{name:34s} {rate:5.2f} {1e3 * t['sequential']:8.1f} {1e3 * t['vectorized']:10.1f} "
              f"{t['sequential'] / t['vectorized']:6.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
