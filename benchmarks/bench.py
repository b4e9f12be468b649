"""``make bench``: seconds per round of client work for the sequential reference and the vectorized executor.

Everything is measured in the same run on the device asked for (``--device cpu|cuda|auto``; on the CPU with one
thread unless ``--threads``), and reported as the median over ``--rounds`` rounds after one warm-up round, with the
ratio to the sequential fp32 reference of the same workload. The clock (``Bench.clock``) is CPU time on the CPU
(``time.thread_time`` on one thread, ``time.process_time`` on more), so that other processes on a shared machine
do not count, and wall time on CUDA. Autocast follows the device: bf16 on CUDA (fp32 too), none on the CPU unless
``--autocast`` asks for bf16. The device is synchronised before each clock read. Per variant: s/round, training
samples per second (samples visited by local SGD, all epochs), peak memory (CUDA: the allocator's peak for that
variant; CPU: the process's peak RSS so far), host reads per round (``fl_lightning.engine.host_syncs``: each one would
stall a GPU) and, on CUDA, the GPU utilisation sampled while the rounds ran. The two executors take turns round by
round, so that load from other processes on a shared machine slows both alike.

Workloads (``--workloads``; any module in ``EXTRA_MODULES`` may register more with ``@workload(name)``):

* ``pfllib_cnn``: PFLlib's FedAvgCNN on CIFAR-10-shaped random tensors, 100 clients × 500 train / 100 test images,
  10 clients per round, FedRep with 10 head epochs + 1 body epoch, batch 10, SGD lr 0.01, momentum 0.5;
* ``fedrep_cnn_aug``: the FedRep authors' CNNCifar on the same data with batched crop+flip augmentation;
* ``methods_cnn``: every exported gradient algorithm (``gradient_algorithms``) on ``pfllib_cnn``'s data and network
  with its constructor's defaults, the sequential reference against ``model.executor: auto``, each method's
  seq/auto with its band and verdict (``ratio_band``, ``verdict``), and its sequential s/round over FedAvg's
  (``--methods`` picks some, ``--clients`` / ``--samples`` shrink it);
* ``fedrep_phases``: ``pfllib_cnn``'s round split into FedRep's head and body phases, per executor, and the
  speedup ceiling the body phase sets;
* ``conv_clients``: a body epoch of 10 clients' per-client conv weights, client by client vs ``vmap`` (one grouped
  convolution): the measurement behind ``fl_lightning.engine.stacked.CONV_CLIENTS`` on this device;
* ``digits_fedavg``: FedAvg on the digits quickstart split; ``digits_precision``: bf16 vs fp32 accuracy;
* ``scale``: FedRep with personal heads on 100 vs 10,000 clients, 100 sampled per round;
* ``run_axis`` (``benchmarks/batched_runs.py``): several runs batched vs one after another; it writes
  its own table and ``results.json`` under ``results/bench/run_axis/``.

It prints a table and writes ``results.json`` (metrics ``train_s_per_round``, ``samples_per_s``, ``speedup``,
``peak_mem_mb``, ``host_reads_per_round``, ``gpu_util_pct``, ``eval_s``; ``methods_cnn`` adds ``seq_over_auto``,
``seq_over_auto_low`` and ``seq_over_auto_high``, with the path and verdict in the ``setting``; the device name in
every ``setting``) and
``round_times.png`` under ``results/bench/``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import platform
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from datamodules.augment import CropFlip
from fl_lightning import algorithms
from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.engine import stacked as executors
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.executor import client_context, decide, vector_context
from fl_lightning.engine.host_syncs import count_host_reads
from fl_lightning.engine.module import FederatedModule
from fl_lightning.engine.rounds import ClientSampler
from fl_lightning.errors import ConfigError
from fl_lightning.models import CifarCNN, DigitsMLP, FedAvgCNN
from fl_lightning.models.split import SplitModel, mlp_layers
from fl_lightning.results import bar_chart, format_table, record, write_results

#: modules that register more workloads when imported
EXTRA_MODULES: tuple[str, ...] = ()
DEFAULT_WORKLOADS = [
    "pfllib_cnn", "methods_cnn", "fedrep_cnn_aug", "fedrep_phases", "conv_clients", "digits_fedavg", "scale",
    "digits_precision", "run_axis",
]  # fmt: skip
WORKLOADS: dict[str, Callable[[Bench], None]] = {}


def workload(name: str) -> Callable[[Callable[[Bench], None]], Callable[[Bench], None]]:
    """Register ``fn(bench)`` as the workload ``name`` (it adds rows and records through ``bench``)."""

    def register(fn: Callable[[Bench], None]) -> Callable[[Bench], None]:
        WORKLOADS[name] = fn
        return fn

    return register


# ---- the device -----------------------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class UtilisationSampler:
    """The GPU's utilisation (%) sampled every 50 ms in a thread while a block runs (``torch.cuda.utilization``,
    which needs pynvml, else ``nvidia-smi``); ``nan`` on other devices or when neither answers."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.samples, self._stop = device, [], threading.Event()

    def read(self) -> float | None:
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:  # no pynvml: ask nvidia-smi
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(index)],
                    capture_output=True, text=True, timeout=2,
                )  # fmt: skip
                return float(out.stdout.strip().splitlines()[0])
            except Exception:
                return None

    def __enter__(self) -> UtilisationSampler:
        if self.device.type == "cuda":
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.read()
            if value is None:
                return
            self.samples.append(value)
            self._stop.wait(0.05)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.device.type == "cuda":
            self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.mean(self.samples) if self.samples else float("nan")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- measuring ------------------------------------------------------------------------------------------------
@dataclass
class Bench:
    """What every workload shares: the options, the device, and the rows and records it adds."""

    args: argparse.Namespace
    device: torch.device
    rows: list[tuple] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    method_rows: list[list] = field(default_factory=list)  #: ``methods_cnn``'s table, printed again at the end
    method_skipped: dict[str, str] = field(default_factory=dict)  #: ``methods_cnn``: method → why it cannot run

    @property
    def name(self) -> str:
        return device_name(self.device)

    @property
    def precisions(self) -> list[str]:
        """fp32 always; bf16 autocast on CUDA, and on the CPU with ``--autocast``."""
        return ["fp32", "bf16"] if self.device.type == "cuda" or self.args.autocast else ["fp32"]

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        if precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def setting(self, workload: str, **extra: Any) -> str:
        parts = [workload, f"device={self.name}"]
        if self.device.type == "cpu":
            parts.append(f"threads={self.args.threads}")
        parts += [f"{k}={v}" for k, v in extra.items()]
        return ",".join(parts)

    def add(self, workload: str, variant: str, metrics: dict[str, float], **setting: Any) -> None:
        """One table row and its records."""
        where = self.setting(workload, **setting)
        for metric, value in metrics.items():
            self.records.append(record("bench", variant, metric, value, setting=where))
        self.rows.append((workload, variant, *(metrics.get(k, float("nan")) for k in TABLE_METRICS)))
        shown = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        print(f"  {workload:16s} {variant:22s} {shown}", flush=True)

    def clock(self) -> float:
        """Seconds for timing a block: CPU time on the CPU (this thread's on one thread, where torch computes in the
        calling thread; the process's on more), so that other processes on a shared machine do not count; wall
        time on CUDA (whose work the host's CPU time does not see)."""
        if self.device.type == "cuda":
            return time.perf_counter()
        return time.thread_time() if self.args.threads == 1 else time.process_time()

    def time_rounds(self, module: FederatedModule, per_round: int, precision: str) -> dict[str, float]:
        """Client work of ``--rounds`` rounds of one module (see ``time_interleaved``)."""
        return self.time_interleaved([module], per_round, precision)[0]

    def interleave(
        self, modules: list[FederatedModule], per_round: int, precision: str
    ) -> list[dict[str, list[float]]]:
        """Client work (``run_clients``) of one warm-up round and ``--rounds`` rounds for each module, the modules
        taking turns round by round on the same cohorts so that a machine whose load drifts slows them alike: per
        module, the seconds (``clock``) and host reads of each round after the warm-up, the GPU utilisation
        samples and the peak memory (``[peak]``)."""
        sampler = ClientSampler(modules[0].fed.num_clients, per_round, seed=0)
        out = [{"times": [], "reads": [], "utils": [], "peak": [0.0]} for _ in modules]
        for r in range(self.args.rounds + 1):
            cohort = sampler.sample(r).tolist()
            for module, seen in zip(modules, out):
                glob = module.global_params()
                states = [module.bank.get(c) for c in cohort]
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                synchronize(self.device)
                with UtilisationSampler(self.device) as util:
                    start = self.clock()
                    with self.autocast(precision), count_host_reads() as counted:
                        module.run_clients(cohort, r, glob, states, [1.0] * len(cohort))
                    synchronize(self.device)
                    spent = self.clock() - start
                if r > 0:  # round 0 warms up (first-call costs, caches)
                    seen["times"].append(spent)
                    seen["reads"].append(float(counted.count))
                    seen["utils"] += util.samples
                seen["peak"][0] = max(seen["peak"][0], peak_memory_mb(self.device))
        return out

    def time_interleaved(
        self, modules: list[FederatedModule], per_round: int, precision: str
    ) -> list[dict[str, float]]:
        """``interleave``'s rounds summarised per module: the median s/round, host reads per round, the mean GPU
        utilisation and the peak memory."""
        return [summarise(seen) for seen in self.interleave(modules, per_round, precision)]

    def time_eval(self, module: FederatedModule, precision: str) -> float:
        synchronize(self.device)
        start = self.clock()
        with self.autocast(precision):
            module.evaluate_clients(0)
        synchronize(self.device)
        return self.clock() - start

    def compare(
        self,
        name: str,
        make_net: Callable[[], SplitModel],
        fed: FederatedData,
        algorithm: Callable[[], Any],
        per_round: int,
        samples_per_round: float,
        precisions: list[str] | None = None,
        evaluate: bool = True,
    ) -> None:
        """The sequential reference and the vectorized executor on one workload, in each precision (the two
        executors take turns round by round)."""
        reference = None
        for precision in precisions or self.precisions:
            modules = []
            for executor in ("sequential", "vectorized"):
                torch.manual_seed(0)
                modules.append(module_for(algorithm(), make_net(), fed, executor, self.device))
            for executor, module, metrics in zip(
                ("sequential", "vectorized"), modules, self.time_interleaved(modules, per_round, precision)
            ):
                if evaluate:
                    metrics["eval_s"] = self.time_eval(module, precision)
                if reference is None:
                    reference = metrics["train_s_per_round"]
                metrics["samples_per_s"] = samples_per_round / metrics["train_s_per_round"]
                metrics["speedup"] = reference / metrics["train_s_per_round"]
                suffix = "" if precision == "fp32" else f"-{precision}"
                self.add(name, executor + suffix, metrics, clients=fed.num_clients, per_round=per_round)


def summarise(seen: dict[str, list[float]]) -> dict[str, float]:
    """One module's rounds of ``Bench.interleave`` as the table's metrics."""
    return {
        "train_s_per_round": statistics.median(seen["times"]),
        "host_reads_per_round": statistics.median(seen["reads"]),
        "gpu_util_pct": statistics.mean(seen["utils"]) if seen["utils"] else float("nan"),
        "peak_mem_mb": seen["peak"][0],
    }


@dataclass(frozen=True)
class RatioBand:
    """A speed ratio ``reference / candidate`` (above 1: the candidate is faster) from paired rounds: the median of
    the per-round ratios and a band around it (``ratio_band``)."""

    median: float
    low: float
    high: float


def ratio_band(
    reference: list[float], candidate: list[float], level: float = 0.9, resamples: int = 2000, seed: int = 0
) -> RatioBand:
    """The per-round ratios ``reference[r] / candidate[r]`` (the two timed in the same round, on the same cohort):
    their median, and the percentile bootstrap band of that median at ``level`` (the rounds resampled with
    replacement ``resamples`` times, a seeded generator: the same samples give the same band). With one round the
    band is that round's ratio."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("ratio_band needs the same positive number of reference and candidate rounds")
    ratios = [a / b for a, b in zip(reference, candidate)]
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int(round((1.0 - tail) * (resamples - 1)))]
    return RatioBand(statistics.median(ratios), low, high)


Verdict = str  #: ``same path``, ``faster``, ``tie`` or ``slower``


def verdict(band: RatioBand, same_path: bool) -> Verdict:
    """How ``auto`` compares with the loop: ``same path`` where ``auto`` decided the loop (the ratio then times the
    loop against itself, noise only), else by the band of seq/auto: ``faster`` (entirely above 1), ``slower``
    (entirely below 1), ``tie`` (it contains 1)."""
    if same_path:
        return "same path"
    if band.low > 1.0:
        return "faster"
    if band.high < 1.0:
        return "slower"
    return "tie"


TABLE_METRICS = (
    "train_s_per_round", "samples_per_s", "speedup", "eval_s", "peak_mem_mb", "host_reads_per_round", "gpu_util_pct",
)  # fmt: skip
TABLE_HEADERS = ["workload", "variant", "s/round", "samples/s", "speedup", "eval_s", "peak_MB", "reads/round", "util%"]


# ---- data and modules ---------------------------------------------------------------------------------------------
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


def module_for(
    algorithm, net, fed: FederatedData, executor: str, device: torch.device | str = "cpu"
) -> FederatedModule:
    aggregation = "uniform" if algorithm.needs_uniform_aggregation else "num_samples"  # FedMTL's exact mean
    module = FederatedModule(
        algorithm, net, lr=0.01, momentum=0.5, batch_size=10, executor=executor, aggregation=aggregation
    )
    module.attach_data(fed)
    module.to(device)
    module.fed = fed.to(device)
    return module


def sizes(args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(train, test images per client, clients, head epochs): the issue's shape, or tiny with ``--quick``;
    ``--samples`` and ``--clients`` override the first and third."""
    train, test, clients, head = (40, 10, 20, 2) if args.quick else (500, 100, 100, 10)
    return getattr(args, "samples", None) or train, test, getattr(args, "clients", None) or clients, head


def gradient_algorithms() -> dict[str, type[algorithms.Algorithm]]:
    """Every exported algorithm that trains with ``ctx.sgd``: the rule is the declared ``supports_frozen``, which
    the closed-form methods (LinearFedAvg, LinearFedRep, AlternatingGD, IFCA and its subclasses FedMD and
    OneShotClustering, PowerInitLocalGD) set to False because their steps are not steps of the client optimiser."""
    found = {}
    for name in algorithms.__all__:
        cls = getattr(algorithms, name)
        if inspect.isclass(cls) and issubclass(cls, algorithms.Algorithm) and cls is not algorithms.Algorithm:
            if cls.supports_frozen:
                found[name] = cls
    return found


# ---- workloads ----------------------------------------------------------------------------------------------------
@workload("pfllib_cnn")
def pfllib_cnn(bench: Bench) -> None:
    n_train, n_test, n_clients, head = sizes(bench.args)
    data = image_data(n_clients, n_train, n_test)
    cohort = min(10, n_clients)
    bench.compare("pfllib_cnn", FedAvgCNN, data, lambda: FedRep(head, 1), cohort, cohort * n_train * (head + 1))


METHOD_HEADERS = [
    "method", "auto path", "sequential s/round", "auto s/round", "seq/auto", "band", "verdict", "seq / FedAvg seq",
]  # fmt: skip
#: the level of ``methods_cnn``'s seq/auto band (``ratio_band``)
BAND_LEVEL = 0.9

#: why a whole-model epoch bounds the stacked path on the CPU (``fedrep_phases``' reasoning, printed with the table)
ARITHMETIC_BOUND = (
    "a whole-model epoch is arithmetic-bound on the CPU: every client trains its own copy of every layer, as in "
    "FedRep's body phase, so stacking clients shares no arithmetic on one thread and saves only per-step overhead "
    "(fedrep_phases measures that ceiling: sequential round / vectorized body phase)"
)


@workload("methods_cnn")
def methods_cnn(bench: Bench) -> None:
    """``pfllib_cnn``'s data and network (FedAvgCNN, batch 10, 10 clients per round) for every gradient algorithm
    with its constructor's defaults (FedRep 10 + 1 epochs, pFedMe 20 steps, the others mostly 1 epoch): s/round of
    the sequential reference and of ``model.executor: auto``, their ratio, which path ``auto`` chose
    (``fl_lightning.engine.executor.decide``), and the method's sequential s/round over FedAvg's sequential s/round
    timed in the same turns (the check of issue 32 that no method's loop costs more than FedAvg's work plus its own
    extra). The three take turns round by round, so that load drifting over the run slows them alike."""
    n_train, n_test, n_clients, _ = sizes(bench.args)
    per_round = min(10, n_clients)
    data = image_data(n_clients, n_train, n_test)
    chosen = gradient_algorithms()
    wanted = bench.args.methods or list(chosen)
    unknown = sorted(set(wanted) - set(chosen))
    if unknown:
        raise SystemExit(f"error: --methods {unknown[0]} is not a gradient algorithm; pick from {' '.join(chosen)}")
    wanted = ["FedAvg", *(n for n in wanted if n != "FedAvg")]  # first: the reference of the last column
    where = bench.setting("methods_cnn", clients=n_clients, per_round=per_round)
    table = []
    for name in wanted:
        modules = []
        try:  # this method's two paths, and FedAvg's loop as the last column's reference, taking turns per round
            for algorithm, executor in ((name, "sequential"), (name, "auto"), ("FedAvg", "sequential")):
                torch.manual_seed(0)
                modules.append(module_for(chosen[algorithm](), FedAvgCNN(), data, executor, bench.device))
        except ConfigError as error:  # the method does not apply to this network (FedBN needs BatchNorm)
            bench.method_skipped[name] = str(error)
            print(f"  methods_cnn      {name}: skipped, {error}", flush=True)
            continue
        path = decide(modules[1], per_round)
        if name == "FedAvg":
            modules.pop()  # its own loop is the reference
        seen = bench.interleave(modules, per_round, "fp32")
        seq, auto, *ref = (summarise(s) for s in seen)
        fedavg = (ref[0] if ref else seq)["train_s_per_round"]
        band = ratio_band(seen[0]["times"], seen[1]["times"], BAND_LEVEL)
        said = verdict(band, path.path == "sequential")
        seq["speedup"] = 1.0
        auto["speedup"] = seq["train_s_per_round"] / auto["train_s_per_round"]
        auto |= {"seq_over_auto": band.median, "seq_over_auto_low": band.low, "seq_over_auto_high": band.high}
        bench.add("methods_cnn", f"{name} sequential", seq, clients=n_clients, per_round=per_round, method=name)
        bench.add("methods_cnn", f"{name} auto", auto, clients=n_clients, per_round=per_round, method=name,
                  path=path.path, verdict=said.replace(" ", "_"))  # fmt: skip
        over = seq["train_s_per_round"] / fedavg
        bench.records.append(record("bench", f"{name} sequential", "fedavg_seq_s_per_round", fedavg, setting=where))
        bench.records.append(record("bench", f"{name} sequential", "seq_over_fedavg_seq", over, setting=where))
        shown = f"{band.low:.3f}-{band.high:.3f}"
        table.append([name, path.path, seq["train_s_per_round"], auto["train_s_per_round"], band.median, shown, said,
                      over])  # fmt: skip
    bench.method_rows = table
    print_methods_table(bench)


def print_methods_table(bench: Bench) -> None:
    """The per-method table of ``methods_cnn`` and the line on where a whole-model epoch is arithmetic-bound."""
    print()
    clock = "CPU" if bench.device.type == "cpu" else "wall"
    print(f"methods_cnn on {bench.name}: {clock} s/round, median of {bench.args.rounds} rounds after a warm-up; "
          f"seq/auto = the median of the rounds' sequential / auto, band = its {BAND_LEVEL:.0%} bootstrap band; "
          "verdict: faster or slower where the band is entirely above or below 1, tie where it holds 1, same path "
          "where auto runs the loop")  # fmt: skip
    print(format_table(METHOD_HEADERS, bench.method_rows))
    for name, why in bench.method_skipped.items():
        print(f"  {name} skipped: {why}")
    print(f"  {ARITHMETIC_BOUND}")
    ceilings = [r["value"] for r in bench.records if r["metric"] == "speedup_ceiling"]
    if ceilings:
        print(f"  fedrep_phases in this run: the body phase bounds the round's speedup at {ceilings[-1]:.2f}×")


@workload("fedrep_cnn_aug")
def fedrep_cnn_aug(bench: Bench) -> None:
    n_train, n_test, n_clients, head = sizes(bench.args)
    data = image_data(n_clients, n_train, n_test, augment=CropFlip(4))
    cohort = min(10, n_clients)
    bench.compare("fedrep_cnn_aug", CifarCNN, data, lambda: FedRep(head, 1), cohort, cohort * n_train * (head + 1))


@workload("fedrep_phases")
def fedrep_phases(bench: Bench) -> None:
    """``pfllib_cnn``'s round split into FedRep's phases, per executor (fp32): the head phase (10 epochs, frozen shared
    body) and the body phase (1 epoch, each client its own body). The vectorized body phase has no work to share
    between clients, so on a device that already runs one client's convolutions at full width (one CPU thread) the
    round's speedup is at most sequential round / vectorized body phase."""
    n_train, n_test, n_clients, head = sizes(bench.args)
    data = image_data(n_clients, n_train, n_test)
    cohort = ClientSampler(n_clients, min(10, n_clients), seed=0).sample(0).tolist()
    modules, spent = {}, {}
    for executor in ("sequential", "vectorized"):  # built first, then the executors take turns round by round
        torch.manual_seed(0)
        modules[executor] = module_for(FedRep(head, 1), FedAvgCNN(), data, executor, bench.device)
        spent[executor] = {"head phase": [], "body phase": []}
    for r in range(bench.args.rounds):
        for executor, module in modules.items():
            glob = module.global_params()
            if executor == "sequential":
                contexts = [client_context(module, c, r) for c in cohort]
                params = [{**glob, **module.bank.get(c)} for c in cohort]
            else:
                contexts = [vector_context(module, cohort, r, [1.0] * len(cohort))]
                params = [{**{n: v.expand(len(cohort), *v.shape) for n, v in glob.items()},
                           **module.bank.gather(torch.tensor(cohort, device=bench.device))}]  # fmt: skip
            for phase, names, epochs in (("head phase", ("head.",), head), ("body phase", (), 1)):
                synchronize(bench.device)
                start = bench.clock()
                for k, ctx in enumerate(contexts):
                    trained = ctx.params_with(names) if names else ctx.params_without(("head.",))
                    params[k] = ctx.sgd(params[k], trained, epochs)
                synchronize(bench.device)
                spent[executor][phase].append(bench.clock() - start)
    for executor, phases in spent.items():
        for phase, times in phases.items():
            bench.add("fedrep_phases", f"{executor} {phase}", {"train_s_per_round": statistics.median(times)})
    seq = sum(statistics.median(t) for t in spent["sequential"].values())
    ceiling = seq / statistics.median(spent["vectorized"]["body phase"])
    print(f"  fedrep_phases: the vectorized body phase alone bounds the round's speedup at {ceiling:.2f}×")
    where = bench.setting("fedrep_phases")
    bench.records.append(record("bench", "vectorized", "speedup_ceiling", ceiling, setting=where))


@workload("digits_fedavg")
def digits_fedavg(bench: Bench) -> None:
    from datamodules import DigitsDataModule

    digits = DigitsDataModule(num_clients=20, participation=0.2, seed=0)
    digits.setup()
    samples = float(sum(digits.federated.train.host_sizes(range(20)))) / 5  # 4 of 20 clients, 1 epoch
    bench.compare("digits_fedavg", DigitsMLP, digits.federated, lambda: FedAvg(1), 4, samples, ["fp32"])


@workload("conv_clients")
def conv_clients(bench: Bench) -> None:
    """One body epoch (FedRep's body phase) of 10 clients with their own conv weights: client by client vs vmap."""
    n_train = sizes(bench.args)[0]
    data = image_data(10, n_train, 1)
    net = FedAvgCNN().to(bench.device)
    glob = {n: p.detach() for n, p in net.named_parameters()}
    heads = {n: v.expand(10, *v.shape).clone() for n, v in glob.items() if n.startswith("head.")}
    fed = data.to(bench.device)
    times = {}
    for strategy in ("loop", "vmap"):
        module = module_for(FedRep(1, 1), net, data, "vectorized", bench.device)
        module.fed = fed
        spent = []
        for r in range(bench.args.rounds + 1):
            ctx = vector_context(module, list(range(10)), r, [1.0] * 10)
            ctx.loop_over_clients = strategy == "loop"
            params = {**{n: v.expand(10, *v.shape) for n, v in glob.items()}, **heads}
            synchronize(bench.device)
            start = bench.clock()
            ctx.sgd(params, ctx.params_without(("head.",)), 1)
            synchronize(bench.device)
            spent.append(bench.clock() - start)
        times[strategy] = statistics.median(spent[1:])
        metrics = {"train_s_per_round": times[strategy], "samples_per_s": 10 * n_train / times[strategy]}
        bench.add("conv_clients", strategy, metrics)
    best = min(times, key=times.get)
    configured = executors.conv_clients(bench.device)
    print(f"  conv_clients: {best} is faster on {bench.name}; CONV_CLIENTS uses {configured} for {bench.device.type}")
    where = bench.setting("conv_clients", configured=configured)
    bench.records.append(record("bench", best, "loop_over_vmap_time", times["loop"] / times["vmap"], setting=where))


@workload("digits_precision")
def digits_precision(bench: Bench) -> None:
    """bf16's accuracy and speed effect on the digits quickstart (FedRep, 100 rounds, vectorized executor)."""
    from fl_lightning.cli import train_config

    rounds = "10" if bench.args.quick else "100"
    accelerator = "gpu" if bench.device.type == "cuda" else "cpu"
    for precision in ("32-true", "bf16-mixed"):
        summary = train_config(
            ["configs/quickstart.yaml"],
            ["--trainer.max_steps", rounds, "--trainer.precision", precision, "--trainer.accelerator", accelerator,
             "--model.executor", "vectorized", "--trainer.enable_checkpointing", "false"],
            run_dir=bench.args.out / f"quickstart_{precision}",
        )  # fmt: skip
        metrics = {"acc_last10": summary["last10"], "wall_s": summary["wall_s"]}
        bench.add("digits_precision", f"vectorized-{precision}", metrics, rounds=rounds)


@workload("scale")
def scale(bench: Bench) -> None:
    head = sizes(bench.args)[3]
    times = {}
    for total in (100, 2000 if bench.args.quick else 10_000):
        fed = image_data(total, 20, 5, shape=(32,), seed=1)
        for executor in ("sequential", "vectorized"):
            torch.manual_seed(0)
            module = module_for(FedRep(head, 1), TinyMLP(), fed, executor, bench.device)
            metrics = bench.time_rounds(module, 100, "fp32")
            metrics["client_state_bytes_per_client"] = module.bank.bytes_per_client()
            times[(total, executor)] = metrics["train_s_per_round"]
            bench.add(f"scale_{total}", executor, metrics, clients=total, per_round=100)
    big = max(t for t, _ in times)
    for executor in ("sequential", "vectorized"):
        ratio = times[(big, executor)] / times[(100, executor)]
        print(f"  scale ({executor}): {big} clients / 100 clients round time = {ratio:.2f}×")
        where = bench.setting(f"{big}_vs_100_clients")
        bench.records.append(record("bench", executor, "scale_ratio", ratio, setting=where))


@workload("run_axis")
def run_axis(bench: Bench) -> None:
    """Several runs batched vs one after another (``benchmarks/batched_runs.py``; its own table and results.json)."""
    import shlex

    from benchmarks import batched_runs

    extra = shlex.split(bench.args.run_axis_args or "")
    batched_runs.main(["--out", str(bench.args.out / "run_axis"), *(["--quick"] if bench.args.quick else []), *extra])


# ---- main ---------------------------------------------------------------------------------------------------------
def load_extra_workloads() -> None:
    for name in EXTRA_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        raise SystemExit(2)
    return device


def main(argv: list[str] | None = None) -> int:
    load_extra_workloads()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if available)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per measurement (median; after a warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--clients", type=int, help="clients in the image workloads (default 100, --quick 20)")
    parser.add_argument("--samples", type=int, help="training images per client (default 500, --quick 40)")
    parser.add_argument("--methods", nargs="+", metavar="NAME", help="methods_cnn: these methods only (and FedAvg)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--autocast", action="store_true", help="also bf16 autocast on the CPU")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True, help="TF32 on CUDA (train.py's)")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument(
        "--run_axis_args", default="", metavar="ARGS",
        help="run_axis: more options of python -m benchmarks.batched_runs, e.g. '--seeds 2'",
    )  # fmt: skip
    parser.add_argument(
        "--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=sorted(WORKLOADS), metavar="NAME",
        help=f"which workloads (default: {' '.join(DEFAULT_WORKLOADS)}; all: {' '.join(sorted(WORKLOADS))})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from fl_lightning.cli import set_tf32

    set_tf32(args.tf32)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bench = Bench(args, resolve_device(args.device))
    threads = f", {args.threads} thread(s)" if bench.device.type == "cpu" else ""
    print(f"device: {bench.name} ({bench.device}){threads}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.workloads:
        try:
            WORKLOADS[name](bench)
        except BaseException:  # what the earlier workloads measured is kept; the error follows
            path = write_results(bench.records, args.out)
            print(f"workload {name} failed; results.json keeps the {len(bench.records)} records before it: {path}")
            raise
        write_results(bench.records, args.out)  # as it goes: a failure later keeps this workload's records

    print()
    clock = "CPU" if bench.device.type == "cpu" else "wall"
    print(f"client work per round on {bench.name} ({clock} time), median of {args.rounds} rounds after a warm-up; "
          "speedup vs sequential fp32")  # fmt: skip
    print(format_table(TABLE_HEADERS, bench.rows))
    if bench.method_rows:
        print_methods_table(bench)
    timed = [(w, v, t) for w, v, t, *_ in bench.rows if t == t and not w.startswith(("scale", "digits_precision"))]
    if timed:
        bar_chart(args.out / "round_times.png", [f"{w}\n{v}" for w, v, _ in timed], [t for *_, t in timed],
                  "seconds per round", f"client work per round ({bench.name})")  # fmt: skip
    path = write_results(bench.records, args.out)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
