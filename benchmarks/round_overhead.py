"""The framework's own CPU work per round, with a few near-empty clients (issue 42, item 4).

``python -m benchmarks.round_overhead [--rounds 200] [--repeats 3] [--executors auto sequential vectorized]
[--profile auto]``

Workload: the digits quickstart split (``configs/quickstart.yaml``: 20 clients, 4 per round, DigitsMLP) with FedAvg
of 1 local epoch and a batch size of 128, above every client's training rows, so that each client takes one
minibatch, and ``trainer.val_check_interval`` so large that only the last ``eval_last`` rounds evaluate (scoring
is client work; ``train.py`` evaluates every client after every round by default). Each executor runs ``train.py``
in this process (``fl_lightning.cli.train_config``) twice: for ``--base`` rounds and for ``--base + --rounds``
rounds. Both runs evaluate alike (the last ``eval_last`` rounds and the end of fit) and set up alike, so the
difference of their CPU seconds (``time.process_time``), divided by ``--rounds``, is the CPU time of one more
training round, with nothing else in it. The clients' own work (``FederatedModule.run_clients``, timed the same
way) is subtracted to give the framework's part: sampling, the state bank, aggregation, the server step, logging,
checkpoint saves (every 10 rounds) and Lightning's loop. Each figure is the median over ``--repeats`` pairs of runs,
one thread. ``--profile EXECUTOR`` prints a cProfile of the longer run instead (setup and the final evaluation
included; ``--top`` lines, ``--sort`` order).

The ``framework ms`` column is what issue 42 asks to be at most 5 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

QUICKSTART = "configs/quickstart.yaml"
#: FedAvg, one local epoch, one minibatch per client (digits clients hold at most ~100 training rows)
OVERRIDES = [
    "--model.algorithm", "fl_lightning.algorithms.FedAvg",
    "--model.algorithm.init_args.local_epochs", "1",
    "--model.batch_size", "128",
    "--trainer.val_check_interval", "100000",
]  # fmt: skip


@contextlib.contextmanager
def client_seconds() -> Iterator[list[float]]:
    """CPU seconds spent inside ``FederatedModule.run_clients`` while the block runs (``[total]``)."""
    from fl_lightning.engine.module import FederatedModule

    spent = [0.0]
    original = FederatedModule.run_clients

    def timed(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.process_time() - start

    FederatedModule.run_clients = timed  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        FederatedModule.run_clients = original  # type: ignore[method-assign]


def one_run(executor: str, rounds: int, run_dir: Path, profile: cProfile.Profile | None = None) -> tuple[float, float]:
    """(CPU seconds of the whole run, CPU seconds of its clients' work) of ``rounds`` rounds."""
    from fl_lightning.cli import train_config

    if run_dir.exists():
        shutil.rmtree(run_dir)
    extra = [*OVERRIDES, "--trainer.max_steps", str(rounds), "--model.executor", executor]
    with contextlib.redirect_stdout(io.StringIO()), client_seconds() as clients:
        start = time.process_time()
        if profile is not None:
            profile.enable()
        train_config([QUICKSTART], extra, run_dir=run_dir)
        if profile is not None:
            profile.disable()
        total = time.process_time() - start
    return total, clients[0]


def measure(executor: str, base: int, rounds: int, repeats: int, root: Path) -> dict[str, float]:
    """Median ms per extra round: the whole round, its clients' work, and the rest (the framework)."""
    one_run(executor, 1, root / "warm-up")  # imports and first-call costs
    totals, clients = [], []
    for _ in range(repeats):
        short_total, short_clients = one_run(executor, base, root / "short")
        long_total, long_clients = one_run(executor, base + rounds, root / "long")
        totals.append((long_total - short_total) / rounds)
        clients.append((long_clients - short_clients) / rounds)
    frameworks = [t - c for t, c in zip(totals, clients)]
    return {
        "round": 1e3 * statistics.median(totals),
        "clients": 1e3 * statistics.median(clients),
        "framework": 1e3 * statistics.median(frameworks),
    }


def profile_rounds(executor: str, base: int, rounds: int, top: int, root: Path, sort: str = "tottime") -> str:
    """cProfile of ``rounds`` rounds past ``base`` (the difference is not taken: setup and the final evaluation
    are in the profile, but the extra rounds dominate it when ``rounds`` is large)."""
    one_run(executor, 1, root / "warm-up")
    profile = cProfile.Profile()
    one_run(executor, base + rounds, root / "long", profile)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="extra rounds of the longer run")
    parser.add_argument("--base", type=int, default=20, help="rounds of the shorter run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--executors", nargs="+", default=["auto", "sequential", "vectorized"])
    parser.add_argument("--profile", metavar="EXECUTOR", help="print a cProfile of one executor's run instead")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime", help="the profile's order (pstats: tottime, cumulative, ...)")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="round_overhead_") as tmp:
        root = Path(tmp)
        if args.profile:
            print(profile_rounds(args.profile, args.base, args.rounds, args.top, root, args.sort))
            return 0
        print(f"digits, FedAvg 1 epoch, 4 clients/round of one minibatch each; CPU ms per round (1 thread, median of "
              f"{args.repeats}; {args.base + args.rounds} rounds minus {args.base})")  # fmt: skip
        print(f"{'executor':12s} {'round ms':>9s} {'clients ms':>11s} {'framework ms':>13s}")
        for executor in args.executors:
            t = measure(executor, args.base, args.rounds, args.repeats, root)
            print(f"{executor:12s} {t['round']:9.2f} {t['clients']:11.2f} {t['framework']:13.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
