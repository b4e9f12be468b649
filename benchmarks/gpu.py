"""``make bench-gpu`` (``python -m benchmarks.gpu``): issue 42's GPU measurements, one command, under 5 minutes.

The workload of issue 42: CIFAR-10-shaped random tensors (``bench.image_data``: 100 clients × 500 training / 100
test images 3×32×32, 2 classes per client), 10 clients per round, PFLlib's CNN (``FedAvgCNN``), batch 10, SGD lr
0.01, momentum 0. Every gradient method of ``make bench``'s per-method table (``bench.gradient_algorithms``) with the
settings of the issue's table where it names one (``ISSUE_SETTINGS``: FedRep 10 head + 1 body epochs, Ditto 1 + 1,
pFedMe K = 5, MOON μ = 1, FedProto λ = 1, FedDyn α = 1), the others with their constructor's defaults.

Parts, in this order (each writes its records to ``results.json`` as soon as it has them, so a late failure or a
machine taken back keeps what was measured; a step that raises is one ``FAILED`` line and a ``failed`` record, the
next steps run, and the exit code is 1; ``--parts`` picks some):

1. ``methods``: per method, a Lightning fit of ``--rounds`` rounds (validation off) with ``model.executor:
   sequential`` and one with ``auto``; s/round is the mean of the rounds after the first (the first holds the
   first-call costs), each round timed from ``on_train_batch_start`` to ``on_train_batch_end`` with the device
   synchronised (the whole round: clients, aggregation, server step, logging). ``auto``'s global model and client
   state after the rounds must equal the loop's to ``rtol = atol = 1e-5`` (``TOLERANCE``, the CUDA tests' in
   ``tests/engine/test_executor.py``; checked only without TF32, as there). Where ``auto`` decides on the loop
   (``executor.decide``: FedAvgSteps, FedALA), its fit is the loop's and is not run twice. FedAvg runs first.
2. ``compute``: FedAvg's training FLOPs per image (forward + backward of one batch of 10, counted by
   ``torch.utils.flop_counter``) × the images a round trains, over its ``auto`` s/round: the achieved TFLOP/s,
   against the card's peak for the precision that ran (``PEAK_TFLOPS`` by ``torch.cuda.get_device_name``;
   ``--peak-tflops`` overrides). Then FedAvg ``auto`` again with ``model.compile`` (``--compile-modes``, default
   ``cudagraphs`` on CUDA, ``compile`` on the CPU) and with ``trainer.precision: bf16-mixed``: s/round, TFLOP/s,
   and the largest difference from the eager fp32 model (compiled: checked against ``TOLERANCE``; bf16: reported);
   on CUDA, the GPU launches of one more round of client work (``launches_per_round``: kernels, copies, graph
   replays, counted by ``torch.profiler``), the overhead ``cudagraphs`` is there to remove.
3. ``grid``: a 5-seed FedAvg grid (``--seeds``, ``--grid-rounds`` rounds, ``train.py``'s defaults otherwise:
   validation after every round, round checkpoints) as one batched job (``run_axis.BatchedRuns``, the experiment
   runner's default job for runs that differ only in their seed) against the same runs one after another in this
   process (``cli.train_config``), after a one-round warm-up of each side; wall seconds, the throughput ratio, and
   every run's largest summary difference (``final``, ``last10``, ``best``, ``final_std``), checked against
   ``TOLERANCE``; on CUDA each side's peak device memory, and how many runs batched this way would fit in
   ``MEMORY_FRACTION`` of the card (its memory / the batched job's peak per run: arithmetic on the measurement,
   for issue 42's item 2).
4. the other methods of part 1.

TF32 is off by default (``--tf32`` turns it on), so that the equality checks are the CUDA tests' and the TFLOP/s
compare with the FP32 peak; ``--tf32`` compares with the dense TF32 peak and reports differences unchecked.

Budget on one H100/H200, by design (not a run of this command: none has had a GPU yet): the client work of the
sequential loops of the 20 methods was 33 s per round together and of their ``auto`` rounds 8 s on an H200 (the
README's ``methods_cnn`` table), so 3 rounds each are about 125 s; the 5-seed × 12-round grid took 29 s batched and
33 s alone there (issue 42); assumed: about 1 s of Lightning set-up and end-of-fit evaluation per fit (40 fits) and
about 40 s to compile FedAvg's ``cudagraphs`` step: about 4 minutes in all. The wall time is printed at the end;
``--methods``, ``--rounds`` and ``--parts`` shorten a run that would not fit. ``--smoke`` runs everything at its
smallest size on the CPU (``tests/benchmarks/test_gpu.py``). It prints each result as it comes, then the tables,
writes ``gpu.png`` and ``results.json`` (``experiment=gpu``, ``method``, ``metric``, ``value``, ``seed`` for the
grid's runs, ``setting`` naming the device, TF32 and sizes) under ``--out``, and prints ``results: PATH`` last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.bench import device_name, gradient_algorithms, image_data, resolve_device, synchronize
from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import FederatedData
from fl_lightning.engine.executor import decide
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import FedAvgCNN
from fl_lightning.results import bar_chart, format_table, record, write_results

#: the tolerance of the CUDA equality tests (``tests/engine/test_executor.py``: ``rtol = atol = 1e-5``)
TOLERANCE = 1e-5
#: the settings issue 42's table names (the others run with their constructor's defaults)
ISSUE_SETTINGS: dict[str, dict[str, Any]] = {
    "FedRep": {"head_epochs": 10, "body_epochs": 1},
    "Ditto": {"local_epochs": 1, "personal_epochs": 1},
    "PFedMe": {"inner_steps": 5},
    "MOON": {"mu": 1.0},
    "FedProto": {"lam": 1.0},
    "FedDyn": {"alpha": 1.0},
}
#: dense peak TFLOP/s from NVIDIA's datasheets (the tensor-core figures without sparsity), by
#: ``torch.cuda.get_device_name`` (or that name and a ``-suffix``); ``--peak-tflops`` gives it for a card not listed
#: (H200 NVL, H100 NVL and others have other peaks: not matched, NaN)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4},
    "NVIDIA H100 80GB HBM3": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4},  # SXM
    "NVIDIA H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0},
    "NVIDIA A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
}
PARTS = ("methods", "compute", "grid")
#: the share of the card's memory that ``batched_runs_per_card`` divides by a batched run's measured peak
MEMORY_FRACTION = 0.9
METHOD_HEADERS = ["method", "auto path", "sequential s/round", "auto s/round", "seq/auto", "max |auto - seq|", "equal"]


# ---- the data, the modules, a timed fit -------------------------------------------------------------------------
class RandomImages(FederatedDataModule):
    """``bench.image_data``'s CIFAR-shaped random tensors as a DataModule (``train.py`` and the run axis build it by
    class path): the same rows for every seed (drawn from generator 0), the seed drives sampling and shuffling."""

    def __init__(self, num_clients: int = 100, clients_per_round: int = 10, train: int = 500, test: int = 100,
                 seed: int | None = None) -> None:  # fmt: skip
        super().__init__(num_clients, clients_per_round=clients_per_round, seed=seed)
        self.train_rows, self.test_rows = train, test
        self._built: FederatedData | None = None

    def build(self) -> FederatedData:
        fed = self._built or image_data(self.num_clients, self.train_rows, self.test_rows)
        self._built = fed
        return FederatedData(fed.train, fed.test, fed.num_classes, seed=self.resolved_seed)


@contextlib.contextmanager
def quiet() -> Any:
    """The runs' own console output (summary tables, ``executor: …`` lines) held back; shown if the block fails."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
            yield
    except BaseException:
        print(held.getvalue()[-4000:])
        raise


class RoundTimer(L.Callback):
    """Seconds of every round (``training_step`` and Lightning's work around it), the device synchronised."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        synchronize(module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        synchronize(module.device)
        self.times.append(time.perf_counter() - self._start)

    @property
    def mean_after_first(self) -> float:
        later = self.times[1:] or self.times
        return statistics.mean(later) if later else float("nan")


def algorithm_for(name: str) -> Any:
    return gradient_algorithms()[name](**ISSUE_SETTINGS.get(name, {}))


def timed_fit(
    args: argparse.Namespace, device: torch.device, data: RandomImages, name: str, executor: str,
    compile_mode: str = "none", precision: str = "32-true",
) -> tuple[FederatedModule, RoundTimer]:  # fmt: skip
    """A fit of ``--rounds`` rounds of method ``name`` (validation off), its rounds timed."""
    algorithm = algorithm_for(name)
    L.seed_everything(0, verbose=False)
    module = FederatedModule(
        algorithm, FedAvgCNN(), lr=0.01, momentum=0.0, batch_size=10, executor=executor, compile=compile_mode,
        aggregation="uniform" if algorithm.needs_uniform_aggregation else "num_samples",
    )  # fmt: skip
    timer = RoundTimer()
    trainer = L.Trainer(
        max_steps=args.rounds, limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator=device.type,
        devices=[device.index] if device.index is not None else 1,
        use_distributed_sampler=False, callbacks=[timer], precision=precision,
    )  # fmt: skip
    with quiet():
        trainer.fit(module, datamodule=data)
    return module, timer


def max_difference(a: FederatedModule, b: FederatedModule) -> tuple[float, bool]:
    """The largest |a − b| over the global model and the client-state bank, and whether every entry is within
    ``TOLERANCE`` (``|a − b| ≤ atol + rtol·|b|``, as ``torch.allclose``)."""
    pairs = [(a.global_params()[n], v) for n, v in b.global_params().items()]
    pairs += [(a.bank.row(n), b.bank.row(n)) for n in b.bank.names] if a.bank.names == b.bank.names else []
    worst, close = 0.0, a.bank.names == b.bank.names
    for x, y in pairs:
        x, y = x.detach().double(), y.detach().double()
        worst = max(worst, float((x - y).abs().max())) if x.numel() else worst
        close = close and bool(torch.allclose(x, y, rtol=TOLERANCE, atol=TOLERANCE))
    return worst, close


def training_flops_per_image(device: torch.device) -> float:
    """FedAvgCNN's forward + backward FLOPs per image (one batch of 10, ``FlopCounterMode``)."""
    from torch.utils.flop_counter import FlopCounterMode

    net = FedAvgCNN().to(device)
    x = torch.randn(10, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (10,), device=device)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / 10


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak since the last reset (MiB); NaN on other devices."""
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def total_memory_mb(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else float("nan")


def release_memory(device: torch.device) -> None:
    """Finished fits' device copies of the data handed back before the next fit."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def others_on_the_card(device: torch.device) -> str:
    """What else holds the card: its memory in use before this command allocated anything (CUDA), for the report."""
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    used = (total - free) / 2**20
    return f"; {used:.0f} MiB of {total / 2**20:.0f} MiB in use at the start (its own CUDA context included)"


#: the CUDA runtime and driver calls that start work on the GPU (a replayed CUDA graph is one launch)
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                      "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})  # fmt: skip


def count_events(fn: Callable[[], Any], names: frozenset[str], cuda: bool) -> int:
    """How many profiler events named in ``names`` one call of ``fn`` records (``torch.profiler``; with ``cuda``
    the CUDA activity too, which records the runtime's launch calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name in names)


def launches_per_round(module: FederatedModule, autocast: torch.dtype | None = None) -> float:
    """GPU work launches (``LAUNCHES``) of one more round of client work (``run_clients`` of the first cohort, after
    the fit: compiled code already there), the launch overhead a CUDA graph removes; NaN off CUDA or when the
    profiler fails (the row keeps its other numbers)."""
    device = module.device
    if device.type != "cuda":
        return float("nan")
    cohort = list(range(min(10, module.fed.num_clients)))

    def one_round() -> None:
        glob = module.global_params()
        with torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext():
            module.run_clients(cohort, module.rounds_trained, glob, [module.bank.get(c) for c in cohort],
                               [1.0] * len(cohort))  # fmt: skip
        torch.cuda.synchronize(device)

    try:
        return float(count_events(one_round, LAUNCHES, cuda=True))
    except Exception as error:  # a profiler that cannot attach: said, not fatal
        print(f"  launches per round not counted: {type(error).__name__}: {error}", flush=True)
        return float("nan")


def compiled_graphs() -> int:
    """Graphs dynamo has captured in this process so far."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def peak_tflops(args: argparse.Namespace, device: torch.device, precision: str) -> float:
    """The card's dense peak for ``precision`` (``fp32``, ``tf32``, ``bf16``), ``--peak-tflops``, or NaN."""
    if args.peak_tflops:
        return args.peak_tflops
    name = device_name(device)
    for card, peaks in PEAK_TFLOPS.items():  # the name itself, or with a form-factor suffix (A100-SXM4-80GB)
        if name == card or name.startswith(card + "-"):
            return peaks[precision]
    return float("nan")


# ---- the benchmark ----------------------------------------------------------------------------------------------
class GpuBench:
    """Options, device, the records written as they come, and the rows of each part's table."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.records: list[dict[str, Any]] = []
        self.tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
        self.fits: dict[tuple[str, str], tuple[FederatedModule, RoundTimer]] = {}
        self.started = time.perf_counter()
        self.data = RandomImages(args.clients, min(10, args.clients), args.samples, args.test_samples, seed=0)

    @property
    def setting(self) -> str:
        a = self.args
        return (f"device={device_name(self.device)},tf32={a.tf32},clients={a.clients},samples={a.samples},"
                f"per_round={min(10, a.clients)},rounds={a.rounds}")  # fmt: skip

    def add(self, method: str, metric: str, value: float, part: str, seed: int | None = None, **extra: Any) -> None:
        """One record; ``extra`` joins the setting (``part,device=…,k=v``)."""
        setting = ",".join([part, self.setting, *(f"{k}={v}" for k, v in extra.items())])
        self.records.append(record("gpu", method, metric, value, seed=seed, setting=setting))

    def save(self) -> Path:
        return write_results(self.records, self.args.out)

    def row(self, part: str, headers: list[str], row: list[Any]) -> None:
        self.tables.setdefault(part, (headers, []))[1].append(row)
        self.save()
        print(f"  [{time.perf_counter() - self.started:6.1f} s] {part}: " + "  ".join(
            f"{h} {row[i]:.4g}" if isinstance(row[i], float) else f"{h} {row[i]}" for i, h in enumerate(headers)
        ), flush=True)  # fmt: skip

    # ---- part 1 -------------------------------------------------------------------------------------------------
    def method(self, name: str) -> None:
        seq_module, seq = timed_fit(self.args, self.device, self.data, name, "sequential")
        with quiet():  # the path auto takes (said by the fits themselves)
            path = decide(FederatedModule(algorithm_for(name), FedAvgCNN(), executor="auto").to(self.device),
                          min(10, self.args.clients))  # fmt: skip
        if path.stacked:
            auto_module, auto = timed_fit(self.args, self.device, self.data, name, "auto")
            diff, equal = max_difference(auto_module, seq_module)
        else:  # auto runs the loop: the same fit
            auto_module, auto, diff, equal = seq_module, seq, 0.0, True
        if name == "FedAvg":  # the reference of the compute part (the other fits are let go: device memory)
            self.fits[(name, "auto")] = auto_module, auto
        s, a = seq.mean_after_first, auto.mean_after_first
        checked = equal if not self.args.tf32 else "n/a (TF32)"
        for metric, value in (("seq_s_per_round", s), ("auto_s_per_round", a), ("seq_over_auto", s / a),
                              ("max_abs_diff_auto_seq", diff)):  # fmt: skip
            self.add(name, metric, value, "methods", path=path.path)
        if not self.args.tf32:
            self.add(name, "auto_equals_seq", float(equal), "methods", path=path.path)
        self.row("methods", METHOD_HEADERS, [name, path.path, s, a, s / a, diff, checked])
        del seq_module, auto_module
        release_memory(self.device)

    # ---- part 2 -------------------------------------------------------------------------------------------------
    COMPUTE_HEADERS = ["variant", "s/round", "TFLOP/s", "peak TFLOP/s", "% of peak", "max |x - eager fp32|", "equal",
                       "graphs", "launches/round"]  # fmt: skip

    def fedavg_reference(self) -> tuple[FederatedModule, RoundTimer]:
        """FedAvg's eager ``auto`` fit (part 1's, or run now)."""
        if ("FedAvg", "auto") not in self.fits:
            self.method("FedAvg")
        return self.fits[("FedAvg", "auto")]

    def report_compute(self, variant: str, seconds: float, precision: str, diff: float, equal: bool | str,
                       graphs: int = 0, launches: float = float("nan")) -> None:  # fmt: skip
        flops = training_flops_per_image(self.device)
        images = min(10, self.args.clients) * self.args.samples  # FedAvg: 1 epoch of each sampled client
        tflops, peak = flops * images / seconds / 1e12, peak_tflops(self.args, self.device, precision)
        for metric, value in (("s_per_round", seconds), ("tflops", tflops), ("peak_tflops", peak),
                              ("fraction_of_peak", tflops / peak), ("max_abs_diff_eager", diff),
                              ("train_flops_per_image", flops), ("compiled_graphs", graphs),
                              ("launches_per_round", launches)):  # fmt: skip
            self.add(f"FedAvg {variant}", metric, value, "compute", precision=precision)
        if isinstance(equal, bool):
            self.add(f"FedAvg {variant}", "equals_eager", float(equal), "compute", precision=precision)
        self.row("compute", self.COMPUTE_HEADERS, [f"FedAvg {variant}", seconds, tflops, peak, 100 * tflops / peak,
                                                   diff, equal, graphs, launches])  # fmt: skip

    def compute(self) -> None:
        """FedAvg's eager ``auto`` round as TFLOP/s against the card's peak."""
        module, timer = self.fedavg_reference()
        self.report_compute("auto", timer.mean_after_first, "tf32" if self.args.tf32 else "fp32", 0.0, True,
                            launches=launches_per_round(module))  # fmt: skip

    def compute_compiled(self, mode: str) -> None:
        """FedAvg ``auto`` with ``model.compile: mode``; graphs: how many dynamo captured (0: no step compiled)."""
        eager, _ = self.fedavg_reference()
        before = compiled_graphs()
        module, t = timed_fit(self.args, self.device, self.data, "FedAvg", "auto", compile_mode=mode)
        diff, equal = max_difference(module, eager)
        self.report_compute(f"auto compile={mode}", t.mean_after_first, "tf32" if self.args.tf32 else "fp32", diff,
                            equal if not self.args.tf32 else "n/a (TF32)", compiled_graphs() - before,
                            launches_per_round(module))  # fmt: skip

    def compute_bf16(self) -> None:
        """FedAvg ``auto`` under ``trainer.precision: bf16-mixed`` (its difference from fp32 reported, not checked)."""
        eager, _ = self.fedavg_reference()
        module, t = timed_fit(self.args, self.device, self.data, "FedAvg", "auto", precision="bf16-mixed")
        diff, _ = max_difference(module, eager)
        self.report_compute("auto bf16-mixed", t.mean_after_first, "bf16", diff, "n/a (bf16)",
                            launches=launches_per_round(module, torch.bfloat16))  # fmt: skip

    # ---- part 3 -------------------------------------------------------------------------------------------------
    def grid(self) -> None:
        from fl_lightning.cli import train_config
        from fl_lightning.experiment.run_axis import BatchedRuns
        from fl_lightning.experiment.run_axis.__main__ import seed_runs

        a = self.args
        seeds, out = list(range(a.seeds)), a.out / "grid"
        config = out / "fedavg_random_images.yaml"
        out.mkdir(parents=True, exist_ok=True)
        config.write_text(grid_config(a, self.device))
        common = ["--trainer.enable_progress_bar", "false", "--tf32", str(a.tf32).lower()]

        def alone(rounds: int, root: Path) -> list[dict[str, Any]]:
            return [train_config([str(config)], [*common, "--trainer.max_steps", str(rounds), "--seed_everything",
                                                 str(s)], run_dir=root / f"s{s}") for s in seeds]  # fmt: skip

        def batched(rounds: int, root: Path) -> list[dict[str, Any]]:
            runs = seed_runs(["--config", str(config), *common, "--trainer.max_steps", str(rounds), "--run_dir",
                              str(root)], seeds)  # fmt: skip
            outcomes = BatchedRuns(runs).run()
            bad = [o for o in outcomes if o.status != "done"]
            if bad:
                raise RuntimeError(f"batched run failed: {bad[0].error}")
            return [o.summary for o in outcomes]

        results: dict[str, tuple[list[dict[str, Any]], float]] = {}
        peaks: dict[str, float] = {}
        for label, fn in (("one after another", alone), ("batched", batched)):
            root = out / label.replace(" ", "_")
            shutil.rmtree(root, ignore_errors=True)
            with quiet():
                fn(1, root / "warm-up")  # imports and first-call costs, outside the timing
                synchronize(self.device)
                reset_peak_memory(self.device)
                start = time.perf_counter()
                summaries = fn(a.grid_rounds, root)
                synchronize(self.device)
            results[label] = summaries, time.perf_counter() - start
            peaks[label] = peak_memory_mb(self.device)
        (solo, solo_s), (batch, batch_s) = results.values()
        per_run = peaks["batched"] / a.seeds  # device memory a batched run costs
        fit = math.floor(MEMORY_FRACTION * total_memory_mb(self.device) / per_run) if per_run > 0 else float("nan")
        keys = ("final", "last10", "best", "final_std")
        worst, equal = 0.0, True
        for s, (x, y) in enumerate(zip(solo, batch)):
            diff = max(abs(x[k] - y[k]) for k in keys)
            worst, equal = max(worst, diff), equal and all(math.isclose(y[k], x[k], rel_tol=TOLERANCE,
                                                                        abs_tol=TOLERANCE) for k in keys)  # fmt: skip
            for label, summary in (("one after another", x), ("batched", y)):
                self.add(f"FedAvg x{a.seeds} {label}", "final_acc", summary["final"], "grid", seed=s)
        speedup = solo_s / batch_s
        for label, seconds in (("one after another", solo_s), ("batched", batch_s)):
            self.add(f"FedAvg x{a.seeds} {label}", "wall_s", seconds, "grid", grid_rounds=a.grid_rounds)
        self.add(f"FedAvg x{a.seeds} batched", "throughput_ratio", speedup, "grid", grid_rounds=a.grid_rounds)
        self.add(f"FedAvg x{a.seeds} batched", "max_abs_summary_diff", worst, "grid", grid_rounds=a.grid_rounds)
        for label, peak in peaks.items():
            self.add(f"FedAvg x{a.seeds} {label}", "peak_mem_mb", peak, "grid", grid_rounds=a.grid_rounds)
        self.add(f"FedAvg x{a.seeds} batched", "batched_runs_per_card", fit, "grid", memory_fraction=MEMORY_FRACTION)
        checked = equal if not a.tf32 else "n/a (TF32)"
        if not a.tf32:
            self.add(f"FedAvg x{a.seeds} batched", "batched_equals_alone", float(equal), "grid")
        self.row("grid", ["runs", "rounds", "alone wall_s", "batched wall_s", "throughput ×", "max summary diff",
                          "equal", "alone peak MB", "batched peak MB", "batched runs per card"],
                 [f"FedAvg x{a.seeds}", a.grid_rounds, solo_s, batch_s, speedup, worst, checked,
                  peaks["one after another"], peaks["batched"], fit])  # fmt: skip


def grid_config(args: argparse.Namespace, device: torch.device) -> str:
    """The grid's ``train.py`` config: FedAvg on ``RandomImages`` with the issue's client optimiser."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    return f"""\
trainer:
  accelerator: {accelerator}
  devices: 1
model:
  algorithm:
    class_path: fl_lightning.algorithms.FedAvg
  network:
    class_path: fl_lightning.models.FedAvgCNN
  lr: 0.01
  momentum: 0.0
  batch_size: 10
data:
  class_path: benchmarks.gpu.RandomImages
  init_args:
    num_clients: {args.clients}
    clients_per_round: {min(10, args.clients)}
    train: {args.samples}
    test: {args.test_samples}
wandb:
  mode: disabled
"""


def print_tables(bench: GpuBench) -> None:
    where = f"{device_name(bench.device)} ({bench.device}), TF32 {'on' if bench.args.tf32 else 'off'}"
    for part, (headers, rows) in bench.tables.items():
        print()
        print(f"{part} on {where}; s/round: mean of rounds 2..{bench.args.rounds}")
        print(format_table(headers, rows))


def plot(bench: GpuBench) -> Path | None:
    rows = bench.tables.get("methods", (None, []))[1]
    if not rows:
        return None
    labels = [f"{r[0]}\n{kind}" for r in rows for kind in ("seq", "auto")]
    values = [v for r in rows for v in (r[2], r[3])]
    path = bench.args.out / "gpu.png"
    bar_chart(path, labels, values, "seconds per round", f"sequential vs auto ({device_name(bench.device)})")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto (default: cuda if available)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest size (4 clients × 8 images, 2 rounds, 2 seeds × 2 rounds), for the CPU")
    parser.add_argument("--rounds", type=int, help="rounds per fit (default 3, --smoke 2); s/round: mean after the 1st")
    parser.add_argument("--clients", type=int, help="clients (default 100, --smoke 4)")
    parser.add_argument("--samples", type=int, help="training images per client (default 500, --smoke 8)")
    parser.add_argument("--test-samples", type=int, help="test images per client (default 100, --smoke 4)")
    parser.add_argument("--seeds", type=int, default=None, help="grid seeds (default 5, --smoke 2)")
    parser.add_argument("--grid-rounds", type=int, help="grid rounds (default 12, --smoke 2)")
    parser.add_argument("--methods", nargs="+", metavar="NAME", help="these methods only (FedAvg always runs first)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--compile-modes", nargs="*", metavar="MODE",
                        help="model.compile modes timed for FedAvg (default: cudagraphs on CUDA, compile on the CPU)")
    parser.add_argument("--peak-tflops", type=float, help="the card's peak TFLOP/s for the precision that runs")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=False,
                        help="TF32 on CUDA (default off: the equality checks are the CUDA tests')")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("results/bench/gpu"))
    args = parser.parse_args(argv)
    small = args.smoke
    for key, full, tiny in (("rounds", 3, 2), ("clients", 100, 4), ("samples", 500, 8), ("test_samples", 100, 4),
                            ("seeds", 5, 2), ("grid_rounds", 12, 2)):  # fmt: skip
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else full)
    device = resolve_device(args.device)
    if args.compile_modes is None:
        args.compile_modes = ["cudagraphs"] if device.type == "cuda" else ["compile"]
    chosen = gradient_algorithms()
    wanted = ["FedAvg", *(n for n in (args.methods or chosen) if n != "FedAvg")]
    unknown = sorted(set(wanted) - set(chosen))
    if unknown:
        raise SystemExit(f"error: --methods {unknown[0]} is not a gradient algorithm; pick from {' '.join(chosen)}")
    os.environ.setdefault("WANDB_MODE", "disabled")
    # Lightning's own lines (its handlers hold the stderr of their import: quiet() cannot catch them), as they were
    # once the command returns; the engine's lines (executor: …) go to the current stderr, which quiet() holds back
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        return run(args, wanted)
    finally:  # a caller in the same process (the tests) gets its logging and TF32 back
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def run(args: argparse.Namespace, wanted: list[str]) -> int:
    """The parts of ``main``'s parsed command, one step after another (see the module docstring)."""
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    from fl_lightning.cli import set_tf32

    set_tf32(args.tf32)
    args.out.mkdir(parents=True, exist_ok=True)
    bench = GpuBench(args, device)
    print(f"device: {device_name(device)} ({device}), TF32 {'on' if args.tf32 else 'off'}; {bench.setting}"
          f"{others_on_the_card(device)}", flush=True)  # fmt: skip
    steps: list[tuple[str, Callable[[], None]]] = []
    if "methods" in args.parts:
        steps.append(("methods FedAvg", lambda: bench.method("FedAvg")))
    if "compute" in args.parts:
        steps.append(("compute", bench.compute))
        steps += [(f"compute compile={mode}", lambda m=mode: bench.compute_compiled(m)) for mode in args.compile_modes]
        if device.type == "cuda" or args.smoke:
            steps.append(("compute bf16-mixed", bench.compute_bf16))
    if "grid" in args.parts:
        steps.append(("grid", bench.grid))
    if "methods" in args.parts:
        steps += [(f"methods {n}", lambda n=n: bench.method(n)) for n in wanted[1:]]
    failed: list[str] = []
    for part, step in steps:
        try:
            step()
        except ConfigError as error:  # a method that does not apply to this network (FedBN needs BatchNorm)
            print(f"  {part}: skipped, {error}", flush=True)
        except Exception as error:  # one failing step costs its own numbers only: a GPU window is short
            line = f"{part}: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            failed.append(line)
            bench.add(part, "failed", 1.0, part.split()[0], error=line[:200].replace(",", ";"))
            path = bench.save()
            print(f"  FAILED {line} (results.json keeps the {len(bench.records)} records so far: {path})", flush=True)
        except BaseException:  # interrupted: what was measured stays
            path = bench.save()
            print(f"part {part} interrupted; results.json keeps the {len(bench.records)} records before it: {path}")
            raise
    print_tables(bench)
    image = plot(bench)
    if image is not None:
        print(f"plot: {image}")
    for line in failed:
        print(f"failed: {line}")
    print(f"wall: {time.perf_counter() - bench.started:.1f} s")
    print(f"results: {bench.save()}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
