"""Ditto on the bundled digits split, three ways side by side (issue 44, "every gap named").

    python tools/ditto_side_by_side.py [--rounds 100] [--seeds 0 1 2] [--personal-epochs 1 10]

* ``pfllib``: a plain-torch loop that schedules Ditto as PFLlib does (``clientditto.py`` / ``serverditto.py``): every
  selected client first trains its personal model for ``plocal_epochs`` epochs of plain SGD with the step
  ``v ← v − lr·(∇f(v) + μ(v − w^t))`` (``PerturbedGradientDescent``), then trains the received global model for
  ``local_epochs`` epochs of plain SGD; minibatches of 10 from a shuffled loader with ``drop_last``; the server
  averages the uploads weighted by training-set size. Personal models start as copies of the initial model.
* ``authors``: the same loop scheduled as the authors' code does (litian96/ditto, ``flearn/trainers_MTL/ditto.py``,
  the non-``dynamic_lam`` branch): for each of ``local_iters`` minibatches, one personal step and one global step
  on the same minibatch; ``local_iters`` here is one epoch's minibatches, for both models.
* ``ours``: ``train.py`` with ``configs/digits/base.yaml`` + ``configs/digits/ditto.yaml`` and the same settings
  (``--momentum`` for the client optimiser, default 0 as in both references).

Each prints the mean client test accuracy of the personal models over the last 10 rounds (mean ± sample std over
the seeds). The split is the one ``train.py`` builds (``DigitsDataModule``, 20 clients × 2 classes, seed = run seed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from datamodules import DigitsDataModule, Shards  # noqa: E402
from fl_lightning.models import DigitsMLP  # noqa: E402


def loader(x: Tensor, y: Tensor, batch: int, g: torch.Generator) -> Iterator[tuple[Tensor, Tensor]]:
    """``DataLoader(shuffle=True, drop_last=True)``: a fresh permutation, only full minibatches."""
    perm = torch.randperm(len(y), generator=g)
    for i in range(0, len(y) - batch + 1, batch):
        idx = perm[i : i + batch]
        yield x[idx], y[idx]


def sgd_step(net: nn.Module, x: Tensor, y: Tensor, lr: float, anchor: list[Tensor] | None, mu: float) -> None:
    """One plain SGD step on the cross-entropy; with ``anchor``, the gradient μ(p − anchor) is added."""
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            d = p.grad if anchor is None else p.grad + mu * (p - anchor[i])
            p.add_(d, alpha=-lr)


@torch.no_grad()
def client_accuracy(net: nn.Module, x: Tensor, y: Tensor) -> float:
    return float((net(x).argmax(1) == y).double().mean())


def reference(
    schedule: str, seed: int, rounds: int, lr: float, mu: float, personal_epochs: int, batch: int, join: float
) -> float:
    """The last-10 mean client accuracy of the personal models under PFLlib's or the authors' schedule."""
    dm = DigitsDataModule(num_clients=20, partition=Shards(2), participation=join, seed=seed)
    fed = dm.build()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    glob = DigitsMLP()
    personal = [DigitsMLP() for _ in range(fed.num_clients)]
    for v in personal:
        v.load_state_dict(glob.state_dict())
    work = DigitsMLP()
    sizes = fed.train.sizes.tolist()
    history: list[float] = []
    k = max(1, round(join * fed.num_clients))
    for _ in range(rounds):
        chosen = torch.randperm(fed.num_clients, generator=g)[:k].tolist()
        w_t = [p.detach().clone() for p in glob.parameters()]
        total = {n: torch.zeros_like(t) for n, t in glob.state_dict().items()}
        for c in chosen:
            x, y = fed.train.client(c)
            work.load_state_dict(glob.state_dict())
            if schedule == "pfllib":  # ptrain() then train()
                for _ in range(personal_epochs):
                    for xb, yb in loader(x, y, batch, g):
                        sgd_step(personal[c], xb, yb, lr, w_t, mu)
                for xb, yb in loader(x, y, batch, g):
                    sgd_step(work, xb, yb, lr, None, 0.0)
            else:  # authors: per minibatch, the personal step then the global step on the same batch
                for xb, yb in loader(x, y, batch, g):
                    sgd_step(personal[c], xb, yb, lr, w_t, mu)
                    sgd_step(work, xb, yb, lr, None, 0.0)
            for n, t in work.state_dict().items():
                total[n] += sizes[c] * t
        n_sel = sum(sizes[c] for c in chosen)
        glob.load_state_dict({n: t / n_sel for n, t in total.items()})
        accs = [client_accuracy(personal[c], *fed.test.client(c)) for c in range(fed.num_clients)]
        history.append(statistics.fmean(accs))
    return statistics.fmean(history[-10:])


def ours(seed: int, rounds: int, lr: float, mu: float, personal_epochs: int, momentum: float, join: float,
         executor: str, out: Path) -> float:
    """``train.py`` with the same settings; its ``last10``."""
    run_dir = out / f"ours_s{seed}_p{personal_epochs}_m{momentum}_{executor}"
    cmd = [
        sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/digits/base.yaml"),
        "--config", str(ROOT / "configs/digits/ditto.yaml"), "--run_dir", str(run_dir), "--overwrite", "true",
        f"--seed_everything={seed}", f"--trainer.max_steps={rounds}", f"--model.lr={lr}",
        f"--model.momentum={momentum}", "--model.drop_last=true", f"--model.executor={executor}",
        f"--model.algorithm.init_args.lam={mu}", f"--model.algorithm.init_args.personal_epochs={personal_epochs}",
        f"--data.init_args.participation={join}", "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads((run_dir / "summary.json").read_text())["last10"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--personal-epochs", type=int, nargs="+", default=[1, 10])
    p.add_argument("--lr", type=float, default=0.005, help="PFLlib's default local_learning_rate")
    p.add_argument("--lam", type=float, default=0.75, help="λ (PFLlib's mu)")
    p.add_argument("--join", type=float, default=1.0, help="share of clients per round (PFLlib's join_ratio 1)")
    p.add_argument("--momentum", type=float, nargs="+", default=[0.0], help="ours' client momentum (references: 0)")
    p.add_argument("--executor", default="auto")
    p.add_argument("--arms", nargs="+", default=["pfllib", "authors", "ours"])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for pe in args.personal_epochs:
            rows: list[tuple[str, list[float]]] = []
            for arm in args.arms:
                if arm == "ours":
                    for m in args.momentum:
                        vals = [ours(s, args.rounds, args.lr, args.lam, pe, m, args.join, args.executor, Path(tmp))
                                for s in args.seeds]
                        rows.append((f"ours (momentum {m})", vals))
                elif arm == "authors" and pe != 1:
                    continue  # the authors' schedule has no separate personal epochs
                else:
                    rows.append((arm, [reference(arm, s, args.rounds, args.lr, args.lam, pe, 10, args.join)
                                       for s in args.seeds]))
            for name, vals in rows:
                sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
                print(f"personal_epochs={pe:<3} {name:<22} last10 {100 * statistics.fmean(vals):6.2f} ± "
                      f"{100 * sd:.2f}  ({', '.join(f'{100 * v:.2f}' for v in vals)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
