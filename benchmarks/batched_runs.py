"""Batched runs (the run axis) against the same runs one after another, measured in the same process.

``python -m benchmarks.batched_runs [--quick] [--rounds N] [--seeds 5] [--workloads digits_fedrep mixed_regression]``

* ``digits_fedrep``: FedRep on the quickstart split (``configs/quickstart.yaml``: 20 digits clients, 4 per round,
  10 head + 1 body epochs, batch 10, DigitsMLP), ``--seeds`` seeds. Reference: the seeds' ``train.py`` runs one
  after another in this process (``fl_lightning.cli.train_config``), with ``--model.executor sequential`` and
  with ``--model.executor vectorized``; then the same runs as one batched job
  (``fl_lightning.experiment.run_axis``). Each seed's final and last-10 accuracy must equal its solo run's (the
  table shows the largest difference).
* ``mixed_regression``: spec 001's simulation (``experiments.mixed_regression``) for 20 seeds, one seed after
  another vs all seeds as one batched job (``run_seeds``), with the largest difference of any number; each job's
  CPU seconds per seed are also split into its compute-heavy parts (``time_parts``: client SVDs, Phase 1,
  assignments, cluster sums, least squares, k-means; the rest is drawing the data and the rounds' updates).

* ``digits_4x5_split`` (only when named): the 4 × 5 digits grid's default command alone, its CPU time split into
  ``SPLIT_PARTS`` charged exclusively (Lightning's loops apart from the hooks they call), in ms per run and round;
  ``--without_logging`` runs it with ``log_scalars`` a no-op, to measure what the rounds' logging costs.

Times are totals on one CPU thread (torch's, and numpy/scipy's BLAS and scikit-learn's OpenMP through
``threadpoolctl``): wall seconds and the process's CPU seconds (on a shared machine the CPU time is the steadier
of the two); the speed-up is reference / batched. The table is printed, ``cpu_seconds.png`` (``plot_cpu``: each
side's CPU seconds, by part for the grids) and ``results.json`` are written (``experiment=run_axis``) and
``results: PATH`` is the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from threadpoolctl import threadpool_limits
from torch import Tensor

from fl_lightning.results import format_table, record, write_results

QUICKSTART = "configs/quickstart.yaml"


@contextlib.contextmanager
def quiet():
    """Runs print their tables; the benchmark prints its own."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def digits_fedrep(args: argparse.Namespace, records: list, rows: list) -> None:
    from fl_lightning.cli import train_config
    from fl_lightning.experiment.run_axis import BatchedRuns
    from fl_lightning.experiment.run_axis.__main__ import seed_runs

    rounds = 10 if args.quick else args.rounds
    seeds = list(range(args.seeds))
    common = ["--trainer.max_steps", str(rounds), "--trainer.enable_progress_bar", "false"]
    setting = f"digits_fedrep,seeds={len(seeds)},rounds={rounds},threads=1"
    out = args.out / "digits_fedrep"

    def one_after_another(executor: str) -> list[dict[str, Any]]:
        summaries = []
        for s in seeds:
            extra = [*common, "--seed_everything", str(s), "--model.executor", executor]
            run_dir = out / f"{executor}" / f"s{s}"
            _clear(run_dir)
            summaries.append(train_config([QUICKSTART], extra, run_dir=run_dir))
        return summaries

    def batched() -> list[dict[str, Any]]:
        runs = seed_runs(["--config", QUICKSTART, *common, "--run_dir", str(out / "batched")], seeds)
        for s in seeds:
            _clear(out / "batched" / f"s{s}")
        outcomes = BatchedRuns(runs).run()
        bad = [o for o in outcomes if o.status != "done"]
        if bad:
            raise RuntimeError(f"batched run failed: {bad[0].error}")
        return [o.summary for o in outcomes]

    with quiet():  # warm-up (imports, first-call costs) outside the timings
        for executor in ("sequential", "vectorized"):
            warm = [*common, "--trainer.max_steps", "1", "--model.executor", executor]
            _clear(out / "warm-up")
            train_config([QUICKSTART], warm, run_dir=out / "warm-up")
    results = {}
    for name, fn in (
        ("sequential", lambda: one_after_another("sequential")),
        ("vectorized", lambda: one_after_another("vectorized")),
        ("batched", batched),
    ):
        with quiet():
            results[name] = timed(fn)
        print(f"  digits_fedrep {name:10s} wall {results[name][1]:7.1f} s  cpu {results[name][2]:7.1f} s", flush=True)
    batched_summaries, b_wall, b_cpu = results["batched"]
    for name in ("sequential", "vectorized"):
        summaries, wall, cpu = results[name]
        diff = max(
            max(abs(a["final"] - b["final"]), abs(a["last10"] - b["last10"]))
            for a, b in zip(summaries, batched_summaries)
        )
        rows.append(["digits_fedrep", f"{len(seeds)} {name} runs", wall, cpu, wall / b_wall, cpu / b_cpu, diff])
        for metric, value in (("wall_s", wall), ("cpu_s", cpu), ("speedup_wall", wall / b_wall),
                              ("speedup_cpu", cpu / b_cpu), ("max_abs_acc_diff", diff)):  # fmt: skip
            records.append(record("run_axis", f"{name} x{len(seeds)}", metric, value, setting=setting))
    rows.append(["digits_fedrep", f"{len(seeds)} runs batched", b_wall, b_cpu, 1.0, 1.0, 0.0])
    records.append(record("run_axis", f"batched x{len(seeds)}", "wall_s", b_wall, setting=setting))
    records.append(record("run_axis", f"batched x{len(seeds)}", "cpu_s", b_cpu, setting=setting))
    for s, (solo, batch) in enumerate(zip(results["sequential"][0], batched_summaries)):
        records.append(record("run_axis", "sequential", "final_acc", solo["final"], seed=s, setting=setting))
        records.append(record("run_axis", "batched", "final_acc", batch["final"], seed=s, setting=setting))


def mixed_regression(args: argparse.Namespace, records: list, rows: list) -> None:
    from experiments.mixed_regression import compare_seed_batching

    seeds = 4 if args.quick else 20
    rounds = 20 if args.quick else args.mr_rounds
    setting = f"mixed_regression,C1,seeds={seeds},rounds={rounds},threads=1"
    with time_parts() as parts:
        (loop, l_wall, l_cpu), (batch, b_wall, b_cpu), diff = compare_seed_batching("C1", seeds, rounds, timed)
    print(f"  mixed_regression loop wall {l_wall:7.1f} s  batched wall {b_wall:7.1f} s", flush=True)
    for name, cpu in (("loop", l_cpu), ("batched", b_cpu)):
        spent = ", ".join(f"{k} {v / seeds:.3f}" for k, v in parts[name].items())
        print(f"  {name}, CPU seconds per seed: {spent} (total {cpu / seeds:.3f})")
    for part, value in parts["batched"].items():
        records.append(record("run_axis", "mixed_regression batched", f"cpu_s_per_seed:{part}", value / seeds,
                              setting=setting))  # fmt: skip
    rows.append(["mixed_regression", f"{seeds} seeds one after another", l_wall, l_cpu, l_wall / b_wall,
                 l_cpu / b_cpu, diff])  # fmt: skip
    rows.append(["mixed_regression", f"{seeds} seeds batched", b_wall, b_cpu, 1.0, 1.0, 0.0])
    for name, wall, cpu in (("loop", l_wall, l_cpu), ("batched", b_wall, b_cpu)):
        records.append(record("run_axis", f"mixed_regression {name}", "wall_s", wall, setting=setting))
        records.append(record("run_axis", f"mixed_regression {name}", "cpu_s", cpu, setting=setting))
    records.append(record("run_axis", "mixed_regression loop", "speedup_wall", l_wall / b_wall, setting=setting))
    records.append(record("run_axis", "mixed_regression loop", "speedup_cpu", l_cpu / b_cpu, setting=setting))
    records.append(record("run_axis", "mixed_regression loop", "max_abs_diff", diff, setting=setting))


# ---- the H100 design figure: arithmetic from sizes, not a measurement ------------------------------------------

H100 = {"memory_gb": 80, "tf32_dense_tflops": 495}  # NVIDIA H100 SXM datasheet (dense TF32 tensor throughput)
ASSUMED = {"sustained_fraction": 0.25, "step_ms": 0.3, "memory_fraction": 0.8, "evaluations": 19}
#: Table 1's columns (spec 000 §3.2, configs/table1): network, clients, cohort, train/test rows per client, rounds
COLUMNS = [
    ("CIFAR-10 100×2", "cifar10", 100, 10, 500, 100, 100, 1),
    ("CIFAR-10 100×5", "cifar10", 100, 10, 500, 100, 100, 1),
    ("CIFAR-10 1000×2", "cifar10", 1000, 100, 50, 10, 100, 5),
    ("CIFAR-100 100×5", "cifar100", 100, 10, 500, 100, 100, 5),
    ("CIFAR-100 100×20", "cifar100", 100, 10, 500, 100, 100, 5),
    ("FEMNIST 150×3", "femnist", 150, 15, 133, 15, 200, 5),
    ("Sent140 183×2", "sent140", 183, 18, 60, 15, 50, 5),
]


def _network(kind: str) -> tuple[Any, Any]:
    from fl_lightning.models import CifarCNN, FemnistMLP
    from fl_lightning.models.fedrep import Sent140LSTM

    if kind == "cifar10":
        return CifarCNN(10), torch.randn(10, 3, 32, 32)
    if kind == "cifar100":
        return CifarCNN(100, wide=True), torch.randn(10, 3, 32, 32)
    if kind == "femnist":
        return FemnistMLP(10), torch.randn(10, 1, 28, 28)
    return Sent140LSTM(freeze_embedding=True), torch.randint(0, 10000, (10, 25))


def _flops_and_activations(net: Any, x: Tensor) -> tuple[float, float, float, float]:
    """Per sample: (fwd+bwd FLOPs of the whole net, fwd FLOPs of the body, fwd+bwd FLOPs of the head on
    features, bytes of every module output) from ``FlopCounterMode`` (LSTMs by 2·4·(in+h)·h per token and
    direction, which the counter does not see)."""
    from torch.utils.flop_counter import FlopCounterMode

    outputs: list[int] = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(
        sum(t.numel() * t.element_size() for t in (o if isinstance(o, tuple) else (o,)) if isinstance(t, Tensor))
    )) for m in net.modules() if not list(m.children())]  # fmt: skip
    lstm = sum(
        2 * 4 * (m.input_size + m.hidden_size) * m.hidden_size * x.shape[1] * m.num_layers
        for m in net.modules() if isinstance(m, torch.nn.LSTM)
    )  # fmt: skip
    with FlopCounterMode(display=False) as train:
        net(x).float().sum().backward()
    for h in hooks:
        h.remove()
    with FlopCounterMode(display=False) as body, torch.no_grad():
        feats = net.body(x)
    head_in = feats.detach().requires_grad_(True)
    with FlopCounterMode(display=False) as head:
        net.head(head_in).sum().backward()
    n = x.shape[0]
    return (train.get_total_flops() + 3 * lstm) / n, (body.get_total_flops() + lstm) / n, head.get_total_flops() / n, \
        sum(outputs) / n  # fmt: skip


def design(args: argparse.Namespace, records: list, rows: list) -> None:
    """FedRep's Table 1 (15 methods × 7 columns × 5 seeds = 525 runs) on one H100, as arithmetic: FLOPs from the
    networks' own ops, memory from their sizes, and two assumptions (``ASSUMED``): the sustained fraction of the
    dense TF32 peak and the fixed cost of one stacked local step (kernel launches). Not a measurement."""
    table = []
    total_compute = total_steps = 0.0
    for name, kind, clients, cohort, n, n_test, rounds, body_epochs in COLUMNS:
        net, x = _network(kind)
        train, body_fwd, head_train, act_bytes = _flops_and_activations(net, x)
        trained = [p for p in net.body.parameters() if p.requires_grad]
        p_body, p_head = sum(p.numel() for p in trained), sum(p.numel() for p in net.head.parameters())
        per_round = cohort * n * (body_epochs * train + body_fwd + 10 * head_train)
        evaluation = ASSUMED["evaluations"] * clients * n_test * body_fwd
        gflop_run = (rounds * per_round + evaluation) / 1e9
        steps = rounds * (10 + body_epochs) * -(-n // 10)  # sequential local steps of a run (batch 10)
        # one run inside a stacked step: its cohort's parameters, gradients and momentum (fp32) and the activations
        # of a batch of 10 kept for the backward pass; plus its bank of personal heads and its global model
        run_mb = (cohort * (3 * 4 * (p_body + p_head) + 2 * 10 * act_bytes) + 4 * (clients * p_head + 3 * p_body)) / 1e6
        per_gpu = int(ASSUMED["memory_fraction"] * H100["memory_gb"] * 1e3 / run_mb)
        compute_s = 75 * gflop_run / (ASSUMED["sustained_fraction"] * H100["tf32_dense_tflops"] * 1e3)
        step_s = 15 * steps * ASSUMED["step_ms"] / 1e3  # 15 jobs (methods) of 5 seeds each, one after another
        total_compute += compute_s
        total_steps += step_s
        table.append([name, f"{(p_body + p_head) / 1e6:.2f}M", gflop_run, steps, run_mb, per_gpu, compute_s, step_s])
        setting = f"design,{name}"
        for metric, value in (("design_gflop_per_run", gflop_run), ("design_steps_per_run", steps),
                              ("design_mb_per_batched_run", run_mb), ("design_runs_per_h100", per_gpu),
                              ("design_compute_s_75_runs", compute_s), ("design_step_s_15_jobs", step_s)):  # fmt: skip
            records.append(record("run_axis", "design", metric, value, setting=setting))
    print()
    print("DESIGN, NOT A MEASUREMENT: FedRep's Table 1 on one H100 (80 GB) with 5 seeds per batched job")
    print(format_table(["column", "params", "GFLOP/run", "steps/run", "MB/run", "runs/H100", "compute_s(75)",
                        "steps_s(15 jobs)"], table))  # fmt: skip
    print(
        f"assumed: {ASSUMED['sustained_fraction']:.0%} of the {H100['tf32_dense_tflops']} TFLOP/s dense TF32 peak "
        f"sustained, {ASSUMED['step_ms']} ms fixed cost per stacked local step, {ASSUMED['evaluations']} evaluations "
        f"of every client per run. 525 runs: compute {total_compute:.0f} s, steps one job at a time "
        f"{total_steps:.0f} s (the 15 jobs of a column overlap on one device when memory allows)"
    )


@contextlib.contextmanager
def time_parts():
    """CPU seconds spent in the simulation's compute-heavy functions, split by phase (``loop`` / ``batched``)."""
    import collections

    from experiments import mixed_regression as mr

    hooks = [(mr, "assign_clusters", "assignments"), (mr.SeedsFedX, "_assign", "assignments"),
             (mr, "fedmd_phase1", "Phase 1"), (mr, "fedmd_phase1_seeds", "Phase 1"),
             (mr, "local_estimate", "least squares"), (mr, "least_squares_seeds", "least squares"),
             (mr, "kmeans", "k-means"), (mr.AffineFedX, "__init__", "client SVDs"),
             (mr.AffineFedX, "_move", "cluster sums"), (mr.SeedsFedX, "_move", "cluster sums")]  # fmt: skip
    parts: dict[str, collections.Counter] = {"loop": collections.Counter(), "batched": collections.Counter()}
    phase = {"now": "loop"}
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in hooks] + [(mr, "run_seeds", mr.run_seeds)]

    def wrap(fn, label):
        def timed_fn(*a, **k):
            start = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                parts[phase["now"]][label] += time.process_time() - start

        return timed_fn

    def batched(*a, **k):
        phase["now"] = "batched"
        return saved[-1][2](*a, **k)

    for owner, name, label in hooks:
        setattr(owner, name, wrap(getattr(owner, name), label))
    mr.run_seeds = batched
    try:
        yield parts
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (a batched job is a child process)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


#: the functions whose CPU time ``cpu_parts`` attributes: (module, function or Class.method, part). None of them
#: calls another one, so no CPU second is charged twice.
PARTS = (("fl_lightning.engine.executor", "run_clients", "client training"),
         ("fl_lightning.engine.evaluation", "evaluate_clients", "client evaluation"),
         ("fl_lightning.engine.aggregation", "Aggregation.collect", "aggregation and server step"),
         ("fl_lightning.engine.module", "FederatedModule._server_step", "aggregation and server step"),
         ("fl_lightning.engine.module", "FederatedModule.log_scalars", "self.log"),
         ("fl_lightning.callbacks", "RoundCheckpoint._save_checkpoint", "checkpoints"),
         ("lightning.pytorch.cli", "LightningCLI.__init__", "run setup (parse, instantiate)"))  # fmt: skip
#: what the executors speed up; the other parts are the same work on every path
CLIENT_PARTS = ("client training", "client evaluation")


@contextlib.contextmanager
def wrapped(parts: tuple, wrap: Callable[[Callable, str], Callable]) -> Any:
    """Each function of ``parts`` ((module, function or Class.method, part)) replaced by ``wrap(function, part)``
    while the block runs, and put back after it."""
    import importlib

    saved = []
    for module_name, path, part in parts:
        *owners, name = path.split(".")
        owner = importlib.import_module(module_name)
        for attribute in owners:
            owner = getattr(owner, attribute)
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, wrap(fn, part))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextlib.contextmanager
def cpu_parts():
    """CPU seconds spent inside ``PARTS`` (per thread, ``time.thread_time``: the run-axis threads take turns, and a
    thread waiting for the lockstep uses none), by part. The client parts are what the executors can speed up; the
    others, and everything else (Lightning's loops, the report), are the same work on every path."""
    spent: dict[str, float] = {part: 0.0 for _, _, part in PARTS}

    def wrap(fn: Callable, part: str) -> Callable:
        def timed_fn(*a: Any, **k: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[part] += time.thread_time() - start

        return timed_fn

    with wrapped(PARTS, wrap):
        yield spent


#: ``digits_4x5_split``'s parts: (module, function or Class.method, part). They may call one another: each is
#: charged its exclusive time (``ExclusiveTimes``), so Lightning's loops appear apart from the hooks they call.
SPLIT_PARTS = (
    ("lightning.pytorch.cli", "LightningCLI.__init__", "run setup (LightningCLI)"),
    ("lightning.pytorch.trainer.trainer", "Trainer.fit", "Lightning fit, outside its loops"),
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.advance", "Lightning training loop"),
    ("fl_lightning.engine.module", "FederatedModule.training_step", "training_step's own work"),
    ("fl_lightning.engine.executor", "run_clients", "client training"),
    ("fl_lightning.engine.aggregation", "Aggregation.collect", "aggregation (collect)"),
    ("fl_lightning.engine.module", "FederatedModule._server_step", "server step"),
    ("fl_lightning.engine.module", "FederatedModule.log_scalars", "log_scalars"),
    ("lightning.pytorch.loops.evaluation_loop", "_EvaluationLoop.run", "Lightning validation loop"),
    ("fl_lightning.engine.evaluation", "evaluate_clients", "client evaluation"),
    ("fl_lightning.engine.module", "FederatedModule.on_validation_epoch_end", "validation epoch end"),
    ("fl_lightning.callbacks", "RoundCheckpoint.on_validation_end", "checkpoints"),
    ("lightning.pytorch.trainer.call", "_call_callback_hooks", "Lightning callback dispatch"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector",
     "_LoggerConnector.update_train_step_metrics", "Lightning logger connector"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector",
     "_LoggerConnector.update_eval_epoch_metrics", "Lightning logger connector"),
)  # fmt: skip


class ExclusiveTimes:
    """CPU seconds per part, each call charged its own time less that of the timed calls inside it (per thread:
    ``clock`` is ``time.thread_time`` unless given)."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        import threading

        self.clock = clock
        self.spent: dict[str, float] = {}
        self._local = threading.local()

    def wrap(self, fn: Callable, part: str) -> Callable:
        self.spent.setdefault(part, 0.0)

        def timed(*a: Any, **k: Any) -> Any:
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)  # the time of the timed calls inside this one
            start = self.clock()
            try:
                return fn(*a, **k)
            finally:
                elapsed = self.clock() - start
                self.spent[part] += elapsed - stack.pop()
                if stack:
                    stack[-1] += elapsed

        return timed


@contextlib.contextmanager
def exclusive_parts(parts: tuple = SPLIT_PARTS, clock: Callable[[], float] = time.thread_time) -> Any:
    """``parts``' functions timed by one ``ExclusiveTimes`` while the block runs (yields its ``spent``)."""
    times = ExclusiveTimes(clock)
    with wrapped(parts, times.wrap):
        yield times.spent


def digits_4x5_split(args: argparse.Namespace, records: list, rows: list) -> None:
    """The 4 × 5 grid's default command alone, its CPU time split by ``SPLIT_PARTS`` (exclusive) in ms per run and
    round; "the rest" is the process's CPU time outside them. ``--without_logging`` makes ``log_scalars`` a no-op:
    what the rounds' logging costs, as the difference of two such runs (its runs log none of their metrics)."""
    from fl_lightning.engine import lightning_logging
    from fl_lightning.experiment.runner import run_experiment
    from fl_lightning.experiment.spec import load_experiment, override

    rounds = 3 if args.quick else args.grid_rounds
    experiment = load_experiment("configs/experiments/table1_digits.yaml")
    experiment = experiment.select("method", ["fedavg", "fedprox", "ditto", "fedrep"]).with_seeds(range(5))
    common = [override("trainer.max_steps", rounds), override("trainer.enable_progress_bar", False),
              override("wandb.mode", "disabled")]  # fmt: skip
    root = args.out / "digits_4x5_split"
    warm = dataclasses.replace(experiment.with_seeds(range(2)), runs_dir=root / "warm-up")
    _clear(root)
    with quiet():
        run_experiment(warm, [*common, override("trainer.max_steps", 1)], out=io.StringIO())
    log_scalars = lightning_logging.log_scalars
    if args.without_logging:
        lightning_logging.log_scalars = lambda module, metrics, prog_bar=False: None
    try:
        exp = dataclasses.replace(experiment, runs_dir=root / "default")
        cpu = cpu_seconds()
        with quiet(), exclusive_parts() as spent:
            result = run_experiment(exp, common, out=io.StringIO())
        cpu = cpu_seconds() - cpu
    finally:
        lightning_logging.log_scalars = log_scalars
    if result.code != 0:
        raise RuntimeError(f"digits_4x5_split: exit code {result.code}")
    run_rounds = 20 * rounds
    parts = {**spent, "the rest": cpu - sum(spent.values())}
    setting = f"digits_4x5_split,rounds={rounds},without_logging={bool(args.without_logging)}"
    table = [[part, 1e3 * v / run_rounds] for part, v in sorted(parts.items(), key=lambda kv: -kv[1])]
    shared = 1e3 * sum(v for part, v in parts.items() if part not in CLIENT_PARTS) / run_rounds
    print(f"  digits_4x5_split: CPU ms per run-round by part (exclusive), without_logging={args.without_logging}")
    print(format_table(["part", "ms per run-round"], table))
    print(f"  digits_4x5_split: shared work per run-round (all but client training and evaluation): {shared:.2f} ms")
    for part, value in parts.items():
        records.append(record("digits_4x5_split", "default command", f"ms_per_run_round:{part}",
                              1e3 * value / run_rounds, setting=setting))  # fmt: skip
    records.append(record("digits_4x5_split", "default command", "shared_ms_per_run_round", shared, setting=setting))
    rows.append(["digits_4x5_split", "20 runs, default command", float("nan"), cpu, float("nan"), float("nan"),
                 float("nan")])  # fmt: skip


def grid(args: argparse.Namespace, records: list, rows: list, name: str, methods: list[str] | None, seeds: int) -> None:
    """An experiment grid (configs/experiments/table1_digits.yaml, or some of its methods) by the runner's default
    command (runs batched, the default executor) against the same grid forced onto ``model.executor: sequential``
    with ``--batch-runs 1``, after one warm-up round of every method on both sides; wall and CPU seconds (this
    process and its children) and the largest difference of any run's final / last10 / best."""
    from fl_lightning.experiment.runner import run_experiment
    from fl_lightning.experiment.spec import load_experiment, override

    rounds = 3 if args.quick else args.grid_rounds
    experiment = load_experiment("configs/experiments/table1_digits.yaml")
    if methods:
        experiment = experiment.select("method", methods)
    experiment = experiment.with_seeds(range(seeds))
    common = [override("trainer.max_steps", rounds), override("trainer.enable_progress_bar", False),
              override("wandb.mode", "disabled")]  # fmt: skip
    setting = f"{name},methods={len(experiment.axes['method'])},seeds={seeds},rounds={rounds}"
    results: dict[str, tuple] = {}
    parts: dict[str, dict[str, float]] = {}
    sides = (("sequential, one at a time", [*common, override("model.executor", "sequential")], 1),
             ("default command", common, None))  # fmt: skip
    # warm-up outside the timings: every method for one round on both sides (imports, first-call costs), which
    # the side measured first would otherwise pay alone
    warm = dataclasses.replace(experiment.with_seeds(range(2)), runs_dir=args.out / name / "warm-up")
    for _, extra, batch_runs in sides:
        _clear(warm.runs_dir)
        with quiet():
            run_experiment(warm, [*extra, override("trainer.max_steps", 1)], batch_runs=batch_runs, out=io.StringIO())
    for label, extra, batch_runs in sides:
        root = args.out / name / label.split(",")[0].replace(" ", "_")
        _clear(root)
        exp = dataclasses.replace(experiment, runs_dir=root)
        wall, cpu = time.perf_counter(), cpu_seconds()
        with quiet(), cpu_parts() as spent:
            result = run_experiment(exp, common if batch_runs is None else extra, batch_runs=batch_runs,
                                    out=io.StringIO())  # fmt: skip
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
        if result.code != 0:
            raise RuntimeError(f"{name} {label}: exit code {result.code}")
        summaries = {str(r.run_dir.relative_to(root)): json.loads((r.run_dir / "summary.json").read_text())
                     for r in exp.runs(extra)}  # fmt: skip
        results[label] = (summaries, wall, cpu)
        parts[label] = {**spent, "everything else": cpu - sum(spent.values())}
        print(f"  {name} {label:26s} wall {wall:7.1f} s  cpu {cpu:7.1f} s", flush=True)
    (ref, r_wall, r_cpu), (fast, f_wall, f_cpu) = results.values()
    n = len(ref)
    print_parts(name, parts, records, setting, n * rounds)
    diff = max(abs(ref[k][m] - fast[k][m]) for k in ref for m in ("final", "last10", "best"))
    rows.append([name, f"{n} runs sequential, one at a time", r_wall, r_cpu, r_wall / f_wall, r_cpu / f_cpu, diff])
    rows.append([name, f"{n} runs, default command", f_wall, f_cpu, 1.0, 1.0, 0.0])
    for metric, value in (("ref_wall_s", r_wall), ("ref_cpu_s", r_cpu), ("wall_s", f_wall), ("cpu_s", f_cpu),
                          ("speedup_wall", r_wall / f_wall), ("speedup_cpu", r_cpu / f_cpu),
                          ("max_abs_diff", diff)):  # fmt: skip
        records.append(record(name, "default command", metric, value, setting=setting))


def print_parts(
    name: str, parts: dict[str, dict[str, float]], records: list, setting: str, run_rounds: int | None = None
) -> None:
    """Each side's CPU seconds by part (``cpu_parts``), and the speed-up the default command would reach if its
    client training and evaluation took no time at all (reference total / the default command's other parts): the
    ceiling that the work both sides share sets on the ratio. With ``run_rounds`` (runs × rounds), each side's
    shared work (every part but client training and evaluation, run setup included) per run and round, in ms:
    the figure issue 42 asks to be at most 5 ms on the 4 × 5 grid."""
    (ref_label, ref), (_, fast) = parts.items()
    table = [[part, ref[part], fast[part], ref[part] / fast[part] if fast[part] else float("inf")] for part in ref]
    print(f"  {name}: CPU seconds by part")
    print(format_table(["part", ref_label.split(",")[0], "default", "ratio"], table))
    ceiling = sum(ref.values()) / sum(v for part, v in fast.items() if part not in CLIENT_PARTS)
    print(f"  {name}: ceiling of the CPU speed-up with client training and evaluation free: {ceiling:.2f}x")
    if run_rounds:
        shared = {label: 1e3 * sum(v for part, v in spent.items() if part not in CLIENT_PARTS) / run_rounds
                  for label, spent in (("sequential", ref), ("default command", fast))}  # fmt: skip
        print(f"  {name}: shared work per run-round (all but client training and evaluation, {run_rounds} "
              f"run-rounds): sequential {shared['sequential']:.2f} ms, default {shared['default command']:.2f} ms")
        for label, value in shared.items():
            records.append(record(name, label, "shared_ms_per_run_round", value, setting=setting))
    for label, spent in (("sequential", ref), ("default command", fast)):
        for part, value in spent.items():
            records.append(record(name, label, f"cpu_s:{part}", value, setting=setting))
    records.append(record(name, "default command", "speedup_cpu_ceiling", ceiling, setting=setting))


def table1_digits(args: argparse.Namespace, records: list, rows: list) -> None:
    """``make reproduce-table1-digits``'s grid: 15 methods × 3 seeds."""
    grid(args, records, rows, "table1_digits", None, 3)


def digits_4x5(args: argparse.Namespace, records: list, rows: list) -> None:
    """A 4-method × 5-seed digits grid (FedAvg, FedProx, Ditto, FedRep of Table 1)."""
    grid(args, records, rows, "digits_4x5", ["fedavg", "fedprox", "ditto", "fedrep"], 5)


def plot_cpu(records: list[dict[str, Any]], path: Path) -> Path | None:
    """One panel per measured workload: each side's CPU seconds as a bar, split into ``cpu_parts``'s parts where the
    workload has them, with its speed-up over the panel's first bar (the reference) on top. None when nothing was
    measured (``design`` is arithmetic)."""
    panels: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        if r["metric"].startswith("cpu_s:"):
            panels.setdefault(r["experiment"], {}).setdefault(r["method"], {})[r["metric"][len("cpu_s:"):]] = r["value"]
        elif r["metric"] == "cpu_s" and r["experiment"] == "run_axis":
            panels.setdefault(r["setting"].split(",")[0], {})[r["method"]] = {"total": r["value"]}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 4.5 * len(panels)), 4.5), squeeze=False)
    for ax, (name, sides) in zip(axes[0], panels.items()):
        totals = [0.0] * len(sides)
        for part in dict.fromkeys(p for spent in sides.values() for p in spent):
            values = [spent.get(part, 0.0) for spent in sides.values()]
            ax.bar(range(len(sides)), values, bottom=totals, label=part)
            totals = [t + v for t, v in zip(totals, values)]
        for x, total in enumerate(totals):
            ax.text(x, total, f"{totals[0] / total:.2f}x" if total else "-", ha="center", va="bottom")
        ax.set_xticks(range(len(sides)), list(sides), rotation=20, ha="right")
        ax.set_ylabel("CPU seconds (1 thread)")
        ax.set_title(name)
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=8)
    fig.suptitle("CPU seconds; on top: speed-up over the first bar", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _clear(run_dir: Path) -> None:
    import shutil

    if run_dir.exists():
        shutil.rmtree(run_dir)


WORKLOADS = {
    "digits_fedrep": digits_fedrep,
    "mixed_regression": mixed_regression,
    "design": design,
    "table1_digits": table1_digits,
    "digits_4x5": digits_4x5,
    "digits_4x5_split": digits_4x5_split,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batched_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--rounds", type=int, default=100, help="digits_fedrep rounds (the quickstart's 100)")
    parser.add_argument("--mr_rounds", type=int, default=400, help="mixed_regression Phase-2 rounds")
    parser.add_argument("--seeds", type=int, default=5, help="digits_fedrep seeds")
    parser.add_argument("--grid_rounds", type=int, default=100, help="table1_digits / digits_4x5 rounds (Table 1: 100)")
    parser.add_argument("--workloads", nargs="+", default=[w for w in WORKLOADS if w != "digits_4x5_split"],
                        choices=list(WORKLOADS))
    parser.add_argument("--without_logging", action="store_true",
                        help="digits_4x5_split: log_scalars a no-op (what the rounds' logging costs)")
    parser.add_argument("--out", type=Path, default=Path("results/bench/run_axis"))
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    threadpool_limits(1)  # and numpy/scipy's BLAS (Phase 1's syrk) and scikit-learn's OpenMP
    records: list = []
    rows: list = []
    for name in args.workloads:
        try:
            WORKLOADS[name](args, records, rows)
        except BaseException:  # what the earlier workloads measured is kept; the error follows
            path = write_results(records, args.out)
            print(f"workload {name} failed; results.json keeps the records before it: {path}")
            raise
        write_results(records, args.out)  # as it goes: a failure later keeps this workload's records
    print()
    print("Batched runs vs the same runs one after another (totals, 1 CPU thread; speed-up = reference / batched)")
    print(format_table(["workload", "runs", "wall_s", "cpu_s", "speedup_wall", "speedup_cpu", "max_abs_diff"], rows))
    plot = plot_cpu(records, args.out / "cpu_seconds.png")
    if plot is not None:
        print(f"plot: {plot}")
    path = write_results(records, args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
