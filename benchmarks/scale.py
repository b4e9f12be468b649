"""Cross-device scale (issue 28): a round's cost against the number of clients that exist.

``python -m benchmarks.scale [--quick] [--sizes 1000 10000 100000] [--big] [--rounds 20] [--out DIR]``
``[--methods fedrep ditto] [--placement auto|device|host|disk] [--cohort 10] [--no_eval]``;
``python -m benchmarks.scale --kill_resume ditto 200000 disk``: ``kill -9`` a run once its round-10 checkpoint
exists, resume it from ``last.ckpt`` and compare its end state with the uninterrupted run's (a hash of the global
model and every written client-state row).

The workload is what a new user would write: ``ScaleData``, a ``FederatedDataModule`` of N synthetic clients
(20 training and 5 test samples each, 64 features, 10 classes, each client with its own label shift), the
``DigitsMLP`` network, 10 clients per round, 20 rounds, a Lightning ``Trainer`` with ``RoundCheckpoint`` saving
every round (``last.ckpt`` plus the newest two). Methods: FedRep (client state = the personal head, 650 floats)
and Ditto (a personal model, 17,226 floats). Each (method, N, placement) runs in its own process, so peak RSS
(``VmHWM``) is that run's; ``RssAnon`` (anonymous memory: the heap, not the page cache of memory-mapped files) is
sampled after every round and evaluation. The periodic evaluation after round 10 scores ``model.eval_clients``
= 1,000 sampled clients; the final one (round 20) scores every client.

Printed per run: training s/round (the mean of rounds 2…20, without checkpoints and evaluations), s per sampled
and per full evaluation, checkpoint seconds and bytes written per checkpoint (the ``.ckpt`` plus the client-state
rows journaled with it), peak RSS, peak ``RssAnon`` and the bank's own size. ``--big`` adds FedRep at 10⁶ clients
(host) and Ditto at 2×10⁵ (``client_state: disk``). ``results.json`` (``experiment=scale``) and ``scale.png`` go
to ``--out``; ``results: PATH`` is the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from datamodules.base import FederatedDataModule
from fl_lightning.callbacks import RoundCheckpoint
from fl_lightning.engine.client_data import ClientSplit, FederatedData

FEATURES, CLASSES, TRAIN, TEST = 64, 10, 20, 5
METHODS = ("fedrep", "ditto")


class ScaleData(FederatedDataModule):
    """N synthetic clients of ``train_per_client`` + ``test_per_client`` samples: x ~ N(0, I₆₄), the label the
    argmax of a shared linear map plus the client's own class shift (so a personal head helps). Built in chunks of
    clients straight into one client-sorted tensor with CSR offsets (no per-client objects)."""

    def __init__(
        self,
        num_clients: int = 1000,
        clients_per_round: int = 10,
        train_per_client: int = TRAIN,
        test_per_client: int = TEST,
        seed: int | None = 0,
    ) -> None:
        super().__init__(num_clients=num_clients, clients_per_round=clients_per_round, seed=seed)
        self.train_per_client, self.test_per_client = train_per_client, test_per_client

    def _split(self, per_client: int, salt: int, w: torch.Tensor) -> ClientSplit:
        n = self.num_clients
        x = torch.empty(n * per_client, FEATURES)
        y = torch.empty(n * per_client, dtype=torch.long)
        g = torch.Generator().manual_seed(self.resolved_seed * 1000 + salt)
        shift_g = torch.Generator().manual_seed(self.resolved_seed * 1000 + 7)
        step = 65536  # clients per chunk
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            rows = slice(lo * per_client, hi * per_client)
            x[rows] = torch.randn(hi * per_client - lo * per_client, FEATURES, generator=g)
            shift = 3.0 * torch.randn(hi - lo, CLASSES, generator=shift_g)
            logits = x[rows] @ w + shift.repeat_interleave(per_client, 0)
            y[rows] = logits.argmax(1)
        return ClientSplit(x, y, torch.arange(n + 1) * per_client)

    def build(self) -> FederatedData:
        w = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(self.resolved_seed))
        train = self._split(self.train_per_client, 1, w)
        test = self._split(self.test_per_client, 2, w)
        return FederatedData(train, test, CLASSES, seed=self.resolved_seed)


def memory() -> dict[str, float]:
    """This process's peak RSS (``VmHWM``) and current ``RssAnon``, in bytes (``/proc/self/status``)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon"):
            out[key] = float(value.split()[0]) * 1024
    return out


def timing_callbacks(run_dir: Path) -> tuple[Any, Any]:
    """A callback that times rounds and evaluations and samples ``RssAnon``, and a ``RoundCheckpoint`` (every round,
    ``last.ckpt`` + the newest two) that times each save and counts the bytes it wrote."""
    import lightning as L

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.rounds: list[float] = []
            self.evals: list[tuple[int, float]] = []
            self.rss_anon = 0.0

        def _sample(self) -> None:
            self.rss_anon = max(self.rss_anon, memory().get("RssAnon", 0.0))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rounds.append(time.perf_counter() - self._t)
            self._sample()

        def on_validation_start(self, trainer, pl_module) -> None:
            self._v = time.perf_counter()

        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self.evals.append((trainer.global_step, time.perf_counter() - self._v))
            self._sample()

    class TimedCheckpoint(RoundCheckpoint):
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.saves: list[tuple[float, float]] = []

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            journal = run_dir / "client_state"
            before = sum(p.stat().st_size for p in journal.glob("rows-*.pt")) if journal.exists() else 0
            t = time.perf_counter()
            super()._save_checkpoint(trainer, filepath)
            seconds = time.perf_counter() - t
            after = sum(p.stat().st_size for p in journal.glob("rows-*.pt")) if journal.exists() else 0
            self.saves.append((seconds, float(Path(filepath).stat().st_size + after - before)))

    checkpoint = TimedCheckpoint(
        dirpath=str(run_dir / "checkpoints"), filename="round{step:05d}", every_n_train_steps=1, save_top_k=2,
        monitor="step", mode="max", save_last=True, auto_insert_metric_name=False,
    )  # fmt: skip
    return Timer(), checkpoint


def algorithm(method: str) -> Any:
    from fl_lightning.algorithms import Ditto, FedRep

    return FedRep(head_epochs=1, body_epochs=1) if method == "fedrep" else Ditto(lam=0.75, local_epochs=1)


def run_one(
    method: str, n: int, placement: str, rounds: int, run_dir: Path, eval_clients: int | None = 1000,
    ckpt_path: str | None = None, evaluate: bool = True, cohort: int = 10,
) -> dict[str, Any]:  # fmt: skip
    """One run in this process: the figures of ``benchmarks.scale`` (see the module docstring)."""
    import lightning as L

    from fl_lightning.engine.module import FederatedModule
    from fl_lightning.models import DigitsMLP

    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    data = ScaleData(num_clients=n, clients_per_round=cohort)
    module = FederatedModule(
        algorithm(method), DigitsMLP(), lr=0.05, momentum=0.5, batch_size=10, eval_last=1,
        client_state=placement, eval_clients=None if eval_clients is None or eval_clients >= n else eval_clients,
    )  # fmt: skip
    timer, checkpoint = timing_callbacks(run_dir)
    trainer = L.Trainer(
        max_steps=rounds, accelerator="cpu", limit_val_batches=1.0 if evaluate else 0, devices=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=max(1, rounds // 2), check_val_every_n_epoch=None, default_root_dir=str(run_dir),
        callbacks=[timer, checkpoint],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    bank = module.bank
    train = timer.rounds[1:] or timer.rounds
    sampled = [s for step, s in timer.evals if step < rounds]
    full = [s for step, s in timer.evals if step >= rounds]
    mem = memory()
    return {
        "method": method, "clients": n, "placement": bank.placement, "rounds": trainer.global_step,
        "rounds_this_process": len(timer.rounds),
        "train_s_per_round": sum(train) / max(len(train), 1),
        "eval_sampled_s": sum(sampled) / len(sampled) if sampled else float("nan"),
        "eval_full_s": sum(full) / len(full) if full else float("nan"),
        "checkpoint_s": sum(s for s, _ in checkpoint.saves) / max(len(checkpoint.saves), 1),
        "checkpoint_bytes": sum(b for _, b in checkpoint.saves) / max(len(checkpoint.saves), 1),
        "peak_rss_bytes": mem.get("VmHWM", float("nan")), "peak_rss_anon_bytes": max(timer.rss_anon, 0.0),
        "bank_bytes": float(bank.bytes_per_client() * n), "wall_s": time.perf_counter() - start,
        "final": module.summary.get("final", float("nan")), "fingerprint": fingerprint(module),
    }  # fmt: skip


def fingerprint(module: Any) -> str:
    """A hash of the global model and of every client-state row that differs from the template (the rows a run
    wrote; on a device bank every row): two runs with the same fingerprint ended in the same state."""
    import hashlib

    h = hashlib.sha256()
    for _, p in sorted(module.net.state_dict().items()):
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    bank = module.bank
    ids = torch.arange(bank.num_clients) if bank.placement == "device" else bank.written.nonzero().flatten()
    h.update(ids.numpy().tobytes())
    for chunk in ids.split(4096):
        for _, rows in sorted(bank.gather(chunk).items()):
            h.update(rows.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def kill_and_resume(method: str, n: int, placement: str, rounds: int, out: Path) -> dict[str, Any]:
    """The uninterrupted run, and a run ``kill -9``-ed once its round-``rounds/2`` checkpoint exists and resumed
    from ``last.ckpt``, both without evaluations: their fingerprints, peak RSS and ``RssAnon``."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}

    def cmd(run_dir: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "benchmarks.scale", "--one", method, str(n), placement, "--rounds", str(rounds),
                "--run_dir", str(run_dir), "--no_eval", *extra]  # fmt: skip

    def finish(run_dir: Path, *extra: str) -> dict[str, Any]:
        done = subprocess.run(cmd(run_dir, *extra), env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{run_dir.name} failed (exit {done.returncode}): {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    full_dir, killed_dir = out / "uninterrupted", out / "killed"
    for d in (full_dir, killed_dir):
        shutil.rmtree(d, ignore_errors=True)
    full = finish(full_dir)
    victim = subprocess.Popen(cmd(killed_dir), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed_dir / "checkpoints" / f"round{rounds // 2:05d}.ckpt"
    while not target.exists():
        if victim.poll() is not None:
            raise SystemExit("the run ended before it could be killed")
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = finish(killed_dir, "--ckpt_path", "last")
    for d in (full_dir, killed_dir):
        shutil.rmtree(d, ignore_errors=True)
    return {"uninterrupted": full, "resumed": resumed, "equal": full["fingerprint"] == resumed["fingerprint"]}


def plan(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    sizes = args.sizes or ([200, 1000] if args.quick else [1000, 10000, 100000])
    runs = [(m, n, args.placement) for n in sizes for m in args.methods]
    if args.host:
        runs += [("ditto", n, "host") for n in sizes if ("ditto", n, "host") not in runs]
    if args.big:
        runs += [("fedrep", 1_000_000, "host"), ("ditto", 200_000, "disk")]
    return runs


def in_subprocess(
    method: str, n: int, placement: str, rounds: int, run_dir: Path, evaluate: bool = True, cohort: int = 10
) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.scale", "--one", method, str(n), placement, "--rounds", str(rounds),
           "--run_dir", str(run_dir), "--cohort", str(cohort), *([] if evaluate else ["--no_eval"])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"run {method} N={n} {placement} failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


ROWS = [
    ("train s/round", "train_s_per_round", 1.0), ("eval s (sampled)", "eval_sampled_s", 1.0),
    ("eval s (all)", "eval_full_s", 1.0), ("ckpt s", "checkpoint_s", 1.0), ("ckpt MB", "checkpoint_bytes", 1e6),
    ("peak RSS GB", "peak_rss_bytes", 1e9), ("RssAnon GB", "peak_rss_anon_bytes", 1e9), ("bank GB", "bank_bytes", 1e9),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N = 200 and 1000, 4 rounds (the test's setting)")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="client counts (default 1e3 1e4 1e5)")
    p.add_argument("--big", action="store_true", help="also FedRep at 1e6 (host) and Ditto at 2e5 (disk)")
    p.add_argument("--host", action="store_true", help="also Ditto with client_state: host at every size")
    p.add_argument("--methods", nargs="*", choices=METHODS, default=list(METHODS))
    p.add_argument("--cohort", type=int, default=10, help="clients per round (the rows a checkpoint writes)")
    p.add_argument("--placement", default="auto", choices=["auto", "device", "host", "disk"])
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("runs/bench/scale"))
    p.add_argument("--inline", action="store_true", help="run in this process (tests; peak RSS is then shared)")
    p.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("--run_dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no_eval", action="store_true", help="no evaluations (training and checkpoints only)")
    p.add_argument("--ckpt_path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill_resume", nargs=3, default=None, metavar=("METHOD", "N", "PLACEMENT"),
                   help="kill -9 a run after its middle checkpoint, resume it, compare with the uninterrupted run")
    args = p.parse_args(argv)
    rounds = args.rounds or (4 if args.quick else 20)
    if args.one:
        method, n, placement = args.one
        result = run_one(method, int(n), placement, rounds, args.run_dir, ckpt_path=args.ckpt_path,
                         evaluate=not args.no_eval, cohort=args.cohort)  # fmt: skip
        print(json.dumps(result))
        return 0
    if args.kill_resume:
        method, n, placement = args.kill_resume
        outcome = kill_and_resume(method, int(n), placement, rounds, args.out / "kill_resume")
        for name in ("uninterrupted", "resumed"):
            r = outcome[name]
            memory_gb = f"peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB  RssAnon {r['peak_rss_anon_bytes'] / 1e9:.2f} GB"
            rounds_done = f"rounds {r['rounds']} ({r['rounds_this_process']} in its last process)"
            print(f"{name}: {rounds_done}  fingerprint {r['fingerprint']}  {memory_gb}  {r['placement']}")
        print(f"kill -9 + resume equals the uninterrupted run: {outcome['equal']}")
        return 0 if outcome["equal"] else 1

    from fl_lightning.results import bar_chart, format_table, record, write_results

    records, rows = [], []
    for method, n, placement in plan(args):
        run_dir = args.out / "runs" / f"{method}_{n}_{placement}"
        shutil.rmtree(run_dir, ignore_errors=True)
        if args.inline:
            result = run_one(method, n, placement, rounds, run_dir, evaluate=not args.no_eval, cohort=args.cohort)
        else:
            try:
                result = in_subprocess(method, n, placement, rounds, run_dir, not args.no_eval, args.cohort)
            except SystemExit as failed:  # one failed size does not hide the others
                print(failed, file=sys.stderr)
                continue
        shutil.rmtree(run_dir, ignore_errors=True)  # a bank on disk is as large as the bank: not kept
        setting = f"N={n},placement={result['placement']},rounds={rounds},cohort={args.cohort},threads=1"
        for _, key, _ in ROWS:
            records.append(record("scale", method, key, result[key], setting=setting))
        rows.append([method, n, result["placement"], *(result[key] / scale for _, key, scale in ROWS)])
        print(format_table(["method", "N", "client_state", *(h for h, _, _ in ROWS)], rows[-1:]), flush=True)
        write_results(records, args.out)  # as it goes: a failure at a later size keeps the sizes measured
    print()
    print(format_table(["method", "N", "client_state", *(h for h, _, _ in ROWS)], rows))
    labels = [f"{r[0]} {r[1]:g} {r[2]}" for r in rows]
    title = "Training seconds per round against the number of clients"
    bar_chart(args.out / "scale.png", labels, [r[3] for r in rows], "training s/round", title)
    print(f"results: {write_results(records, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
