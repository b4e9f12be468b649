"""The measurement behind ``model.executor: auto``'s rule (``fl_lightning.engine.executor.MIN_STACKED_CLIENTS``).

CPU seconds (``time.process_time``) per round of client work (``FederatedModule.run_clients``), the sequential
loop and the stacked path taking turns round by round on the same cohorts, median over ``--rounds`` rounds after
one warm-up round, one thread; then one all-client evaluation per path. Workloads: the digits quickstart split
(20 clients, about 72 training samples each) with FedRep 10+1 epochs and FedAvg 1 epoch at 1, 2 and 4 clients per
round, and tiny synthetic clients (64 features, 10 samples each; the evaluation column of the last two rows
evaluates a federation of 1 and 2 clients). The ratio sequential / stacked above 1 means the stacked path wins.

    OMP_NUM_THREADS=1 python -m benchmarks.executor_auto
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fl_lightning.algorithms import Algorithm, FedAvg, FedRep
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.models import DigitsMLP


def synthetic(num_clients: int, per_client: int, seed: int = 0) -> FederatedData:
    g = torch.Generator().manual_seed(seed)

    def split(k: int) -> ClientSplit:
        x = torch.randn(num_clients * k, 64, generator=g)
        return ClientSplit(x, torch.randint(0, 10, (num_clients * k,), generator=g), torch.arange(num_clients + 1) * k)

    return FederatedData(split(per_client), split(max(per_client // 4, 1)), 10, seed=seed)


def digits() -> FederatedData:
    from datamodules import DigitsDataModule

    dm = DigitsDataModule(num_clients=20, participation=0.2, seed=0)
    dm.setup()
    return dm.federated


def measure(fed: FederatedData, algorithm: Callable[[], Algorithm], per_round: int, rounds: int) -> dict[str, float]:
    """Median CPU seconds per round of each path and of one all-client evaluation."""
    modules = {}
    for executor in ("sequential", "vectorized"):
        torch.manual_seed(0)
        module = FederatedModule(algorithm(), DigitsMLP(), lr=0.01, momentum=0.5, batch_size=10, executor=executor)
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
    out = {name: statistics.median(times) for name, times in spent.items()}
    for name, module in modules.items():
        start = time.process_time()
        module.evaluate_clients(0)
        out[f"eval {name}"] = time.process_time() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
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


if __name__ == "__main__":
    main()
