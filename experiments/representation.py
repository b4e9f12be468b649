"""Representation learning in the two-layer linear setting: spec 004 (FedAvg vs D-GD) and FedRep's synthetic figures.

``python -m experiments representation [--quick] [--trials N] [--out DIR] [--cifar-data DIR] [--parts A,B]``
``[--spec004 D,K,M ...] [--engine004 D,K,M]`` (other sizes than the spec's T1/T2; every generator argument of the
``train.py`` runs is a ``SyntheticLinearDataModule`` argument, docs/generators.md)

Spec 004 (population gradients, α = 0.4, B₀ = Q/√α, w₀ = 0; d, k, M are not in the file, the spec's T1/T2 choices):
  Fig. 1 (dist vs rounds), Fig. 3 (gradient norm; new-client fine-tuning error vs n), Fig. 6 (m = 10 of M = 40),
  τ and α sweeps with fitted log-dist slopes, Proposition 2's construction, and the engine run (``train.py``
  with ``configs/representation/linear_*.yaml``).
FedRep (spec 000 §3.1, §5; the paper's unstated sizes as in the spec / the authors' notebook):
  Fig. 3 (dist vs rounds for FedRep, 10GD-GD, GD-GD at four n), Fig. 7 (F(W, B), 95% CIs over trials),
  Fig. 1 (Local Only / FedSGD / FedRep error across m), Fig. 4 (new-client MSE vs m_new), Method-of-Moments and
  projected-GD initialisations, and the engine run (``configs/representation/fedrep*.yaml``).
``--cifar-data DIR`` also trains spec 004's CIFAR-100 transfer configs (needs the data and a GPU-sized budget).

Engine path vs batched simulation: the ``train.py`` parts (``spec004_engine``: population gradients in float64 with
the held-out clients' fine-tuning; ``fedrep_engine``) run the engine's ``LinearFedAvg``/``LinearFedRep`` and are
replayed by the batched math on the same data, initialisation and cohorts. The batched simulation
(``experiments/linear_representation``) stays for what the engine would run far slower: 10-trial curves, the τ/α
sweeps, Proposition 2, and FedRep's figures with up to 10,000 clients and n-sweeps of new clients.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from experiments import ROOT
from experiments.linear_representation import fedavg_linear as fa
from experiments.linear_representation import fedrep_linear as fr
from fl_lightning.cli import train_config
from fl_lightning.results import format_table, record, write_results

CONFIGS = ROOT / "configs" / "representation"
F64 = torch.float64
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gen(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(sum(s * 1000**i for i, s in enumerate(seed))))


def ci95(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Half-width of the Student-t 95% confidence interval of the mean."""
    n = values.shape[dim]
    if n < 2:
        return torch.zeros_like(values.mean(dim))
    return T975.get(n - 1, 1.96) * values.std(dim) / math.sqrt(n)


def engine_history(run_dir: Path, key: str = "val/dist_B") -> list[tuple[int, float]]:
    """(rounds completed, value) at every evaluation, from the run's ``history.json`` (full precision; the
    logged ``metrics.csv`` holds float32 values)."""
    history = json.loads((run_dir / "history.json").read_text())
    return [(int(h["round"]) + 1, float(h[key])) for h in history if key in h]


# ---- spec 004 ---------------------------------------------------------------------------------------------
def spec004(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    plt, lines = _plt(), []
    trials, rounds, alpha = cfg["trials"], cfg["rounds004"], 0.4
    settings = {f"{name} (d={d},k={k},M={num})": (d, k, num) for name, (d, k, num) in cfg["settings004"].items()}
    cols = len(settings)
    fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 4), squeeze=False)
    fig_g, axes_g = plt.subplots(1, cols, figsize=(5.5 * cols, 4), squeeze=False)
    fig_ft, axes_ft = plt.subplots(1, cols, figsize=(5.5 * cols, 4), squeeze=False)
    axes, axes_g, axes_ft = axes[0], axes_g[0], axes_ft[0]
    rows, ft_rows = [], []
    checkpoints = [t for t in (0, 10, 50, 100, 200, 500, 1000) if t <= rounds]
    for j, (name, (d, k, num)) in enumerate(settings.items()):
        b_star, w_star = fa.spec004_ground_truth(trials, num, d, k, gen(1, j))
        b0, w0 = fa.spec004_init(trials, d, k, alpha, gen(2, j))
        obj = fa.population_objectives(b_star, w_star)
        for tau, label in ((1, "D-GD τ=1"), (2, "FedAvg τ=2")):
            run = fa.fedavg(b0, w0, obj, alpha, tau, rounds, b_star=b_star, w_star=w_star)
            mean = run.dist.mean(1)
            axes[j].semilogy(mean.clamp(min=1e-17), label=label)
            axes_g[j].semilogy(run.grad_norm.mean(1), label=label)
            rows.append((name, label, *[float(mean[t]) for t in checkpoints], float(run.grad_norm[-1].mean())))
            for t in checkpoints:
                records.append(record("spec004_fig1", label, f"dist@{t}", float(mean[t]), setting=name))
            records.append(
                record("spec004_fig3", label, "grad_norm_final", float(run.grad_norm[-1].mean()), setting=name)
            )
            ns = cfg["ft_samples"]
            errs = [fa.finetune_new_client(run.b, run.w, b_star, n, gen(3, j, n)) for n in ns]
            means, stds = [float(e.mean()) for e in errs], [float(e.std()) for e in errs]
            axes_ft[j].errorbar(ns, means, yerr=stds, capsize=3, marker="o", label=label)
            ft_rows.append((name, label, *[f"{m:.3g} ({s:.2g})" for m, s in zip(means, stds)]))
            for n, m, s in zip(ns, means, stds):
                records.append(record("spec004_fig3", label, f"finetune_sq_err@n={n}", m, setting=name))
                records.append(record("spec004_fig3", label, f"finetune_sq_err_std@n={n}", s, setting=name))
        for ax, title in ((axes[j], "dist(B_t, B*)"), (axes_g[j], "‖∇F(B_t, w_t)‖")):
            ax.set(title=f"{name}: {title}, mean of {trials}", xlabel="round")
            ax.legend()
        axes_ft[j].set(xscale="log", yscale="log", xlabel="fine-tuning samples n", ylabel="‖B̂ŵ − B*w*‖²")
        axes_ft[j].set_title(f"{name}: new client after 200 GD steps (mean ± std, {trials} trials)")
        axes_ft[j].legend()
    for f, name in (
        (fig, "spec004_fig1_dist.png"),
        (fig_g, "spec004_fig3_gradnorm.png"),
        (fig_ft, "spec004_fig3_finetune.png"),
    ):
        f.tight_layout()
        f.savefig(out / name, dpi=110)
        plt.close(f)
    lines += [f"Spec 004 Fig. 1/3: FedAvg vs D-GD, population gradients, α=0.4, mean of {trials} trials"]
    lines += [format_table(["setting", "method", *[f"dist@{t}" for t in checkpoints], "‖∇F‖ final"], rows), ""]
    ns = cfg["ft_samples"]
    lines += ["Spec 004 Fig. 3 (right): new-client squared error after fine-tuning, mean (std)"]
    lines += [format_table(["setting", "method", *[f"n={n}" for n in ns]], ft_rows), ""]

    # Fig. 6: partial participation m=10 of M=40 (T2 dimensions)
    d, k, num, part = cfg["fig6"]
    b_star, w_star = fa.spec004_ground_truth(trials, num, d, k, gen(4))
    b0, w0 = fa.spec004_init(trials, d, k, alpha, gen(5))
    obj = fa.population_objectives(b_star, w_star)
    fig6, ax = plt.subplots(figsize=(5.5, 4))
    rows = []
    for tau, label in ((1, "D-GD τ=1"), (2, "FedAvg τ=2")):
        run = fa.fedavg(b0, w0, obj, alpha, tau, rounds, part, gen(6, tau), b_star)
        mean = run.dist.mean(1)
        ax.semilogy(mean.clamp(min=1e-17), label=label)
        rows.append((label, *[float(mean[t]) for t in checkpoints]))
        for t in checkpoints:
            records.append(
                record("spec004_fig6", label, f"dist@{t}", float(mean[t]), setting=f"m={part},M={num},d={d}")
            )
    ax.set(title=f"Fig. 6: m = {part} of M = {num} clients per round", xlabel="round", ylabel="dist(B_t, B*)")
    ax.legend()
    fig6.tight_layout()
    fig6.savefig(out / "spec004_fig6_partial.png", dpi=110)
    plt.close(fig6)
    lines += [f"Spec 004 Fig. 6: partial participation (m={part}, M={num}, d={d}, k={k}), mean dist"]
    lines += [format_table(["method", *[f"dist@{t}" for t in checkpoints]], rows), ""]

    # τ and α sweeps (d=20, k=3, M=20): fitted log10-dist slope per round over the linear phase
    b_star, w_star = fa.spec004_ground_truth(cfg["sweep_trials"], 20, 20, 3, gen(7))
    obj = fa.population_objectives(b_star, w_star)
    fig_s, axes_s = plt.subplots(1, 2, figsize=(11, 4))
    rows = []
    for kind, values, fixed in (("τ", cfg["taus"], 0.4), ("α", cfg["alphas"], 2)):
        ax = axes_s[0 if kind == "τ" else 1]
        for v in values:
            a, tau = (fixed, v) if kind == "τ" else (v, fixed)
            sweep_rounds = cfg["sweep_rounds"] if kind == "τ" else cfg["alpha_rounds"]
            run = fa.fedavg(
                *fa.spec004_init(b_star.shape[0], 20, 3, a, gen(8)), obj, a, tau, sweep_rounds, b_star=b_star
            )
            med = run.dist.median(1).values
            slope = fa.log_slope(med)
            ax.semilogy(med.clamp(min=1e-17), label=f"{kind}={v} (slope {slope:.3g})")
            at = min(300, sweep_rounds) if kind == "α" else min(50, sweep_rounds)
            rows.append((f"{kind}={v}", a, tau, slope, float(med[at]), at))
            records.append(
                record("spec004_sweep", f"FedAvg {kind}={v}", "log10_dist_slope", slope, setting="d=20,k=3,M=20")
            )
            records.append(
                record("spec004_sweep", f"FedAvg {kind}={v}", f"dist@{at}", float(med[at]), setting="d=20,k=3,M=20")
            )
        ax.set(title=f"sweep over {kind} (median of {b_star.shape[0]} trials)", xlabel="round", ylabel="dist")
        ax.legend(fontsize=8)
    fig_s.tight_layout()
    fig_s.savefig(out / "spec004_sweeps.png", dpi=110)
    plt.close(fig_s)
    lines += [
        "Spec 004 τ / α sweeps (d=20, k=3, M=20): fitted slope of log10 median dist per round (1e-12 < dist < 0.3)"
    ]
    lines += [format_table(["run", "α", "τ", "slope", "median dist@t", "t"], rows), ""]

    # Proposition 2
    rows = []
    heads = torch.randn(20, 3, generator=gen(9), dtype=F64)
    b0, w0 = fa.spec004_init(1, 10, 3, alpha, gen(10))
    for delta0 in (0.1, 0.3, 0.5):
        b_a, b_b = fa.dgd_indistinguishable_truths(b0[0], heads, delta0)
        truths = torch.stack([b_a, b_b])
        obj = fa.population_objectives(truths, heads.expand(2, -1, -1))
        dgd = fa.fedavg(b0.expand(2, -1, -1), w0.expand(2, -1), obj, alpha, 1, rounds, b_star=truths)
        fed = fa.fedavg(b0.expand(2, -1, -1), w0.expand(2, -1), obj, alpha, 2, rounds, b_star=truths)
        gap = float((dgd.b[0] - dgd.b[1]).abs().max())
        between = float(fa.distance(b_a[None], b_b[None])[0])
        rows.append((delta0, between, gap, float(dgd.dist[-1].max()), float(fed.dist[-1].max())))
        for metric, value in zip(
            ("dist(B*,B*')", "dgd_iterate_gap", "dgd_final_dist_max", "fedavg_final_dist_max"), rows[-1][1:]
        ):
            records.append(record("spec004_prop2", "construction", metric, value, setting=f"delta0={delta0}"))
    lines += [f"Spec 004 Proposition 2 (d=10, k=3, M=20, {rounds} rounds): two truths with equal B*w̄*"]
    lines += [
        format_table(["δ₀", "dist(B*,B*')", "D-GD iterate gap", "D-GD max final dist", "FedAvg max final dist"], rows)
    ]
    lines += [""]
    return lines


def _engine_setup(base: str, seed: int, data_overrides: dict[str, Any]) -> tuple[Any, Any]:
    """The datamodule and initial network a ``train.py`` run with ``base`` and ``seed_everything=seed`` builds (the
    network's sizes come from the data, as in ``fl_lightning.sizes``)."""
    import lightning as L
    import yaml

    from datamodules import SyntheticLinearDataModule
    from fl_lightning.models import LinearRepresentation

    cfg = yaml.safe_load((CONFIGS / f"{base}.yaml").read_text())
    args = {**cfg["data"]["init_args"], **data_overrides}
    L.seed_everything(seed, verbose=False)
    net = LinearRepresentation(args["dim"], args["rank"])
    dm = SyntheticLinearDataModule(**args)
    dm.setup()
    return dm, net


def _flags(data_overrides: dict[str, Any]) -> list[str]:
    return [f"--data.init_args.{k}={v}" for k, v in data_overrides.items()]


ENGINE004 = (
    ("linear_fedavg", "FedAvg τ=2", 2, "population"),
    ("linear_dgd", "D-GD τ=1", 1, "population"),
    ("linear_fedavg", "FedAvg τ=2, samples", 2, "samples"),
)


def spec004_engine(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    """train.py with configs/representation/linear_*.yaml (float64; population gradients, and once the finite-sample
    ones): dist(B, B*) during training and the held-out clients' fine-tuning error at the end, each replayed by the
    batched path on the same ground truth, initialisation and new-client samples."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    rows = []
    rounds, data = cfg["engine_rounds004"], cfg["engine_data004"]
    dm, net = _engine_setup("linear_base", 0, data)
    fed, new = dm.federated, dm.new_clients
    n, m, d = fed.num_clients, int(fed.train.sizes[0]), dm.dim
    b_star, w_star = fed.extras["B_star"][None], fed.extras["W_star"][None]
    x, y = fed.train.x.reshape(1, n, m, d), fed.train.y.reshape(1, n, m)
    q = torch.linalg.qr(net.body.weight.detach().T.double()).Q[None]
    count, per = new.num_clients, int(new.train.sizes[0])
    new_x, new_y = new.train.x.reshape(count, per, d), new.train.y.reshape(count, per)
    new_theta = new.extras["population_target"]
    for name, label, tau, gradient in ENGINE004:
        run_dir = out / "runs" / f"{name}_{gradient}"
        summary = train_config(
            [CONFIGS / "linear_base.yaml", CONFIGS / f"{name}.yaml"],
            [f"--trainer.max_steps={rounds}", "--trainer.enable_checkpointing=false",
             f"--model.algorithm.init_args.gradient={gradient}", *_flags(data)],
            run_dir=run_dir,
        )  # fmt: skip
        hist = engine_history(run_dir)
        population = gradient == "population"
        objectives = fa.population_objectives(b_star, w_star) if population else fa.sample_objectives(x, y)
        b0 = (q / 0.4**0.5).float().double()  # B₀ = Q/√α as stored in the (float32-built) network
        replay = fa.fedavg(b0, torch.zeros(1, q.shape[2], dtype=F64), objectives, 0.4, tau, rounds, b_star=b_star)
        gap = max(abs(v - float(replay.dist[t, 0])) for t, v in hist)
        b_ft, w_ft = fa.finetune(replay.b.expand(count, -1, -1), replay.w.expand(count, -1), new_x, new_y, 200, 0.01)
        ft = float((torch.einsum("tdk,tk->td", b_ft, w_ft) - new_theta).square().sum(-1).mean())
        line = ax.semilogy([t for t, _ in hist], [max(v, 1e-17) for _, v in hist], marker="o", ls="",
                           label=f"{label} (train.py)")  # fmt: skip
        ax.semilogy(replay.dist[:, 0].clamp(min=1e-17), color=line[0].get_color(), label=f"{label} (batched replay)")
        rows.append((label, summary["rounds"], summary["dist_B"], float(replay.dist[-1, 0]), gap,
                     summary["new_clients_mse"], ft, summary["wall_s"]))  # fmt: skip
        setting = f"train.py, M={n}, d={d}, k={dm.rank}, {gradient} gradients, float64"
        records.append(record("engine_spec004", label, "dist_B_final", summary["dist_B"], setting=setting))
        records.append(record("engine_spec004", label, "max_gap_to_batched", gap, setting=setting))
        records.append(record("engine_spec004", label, f"new_client_sq_err@n={per}", summary["new_clients_mse"],
                              setting=setting))  # fmt: skip
        ft_gap = abs(summary["new_clients_mse"] - ft)
        records.append(record("engine_spec004", label, "new_client_gap_to_batched", ft_gap, setting=setting))
    ax.set(title="LinearFedAvg: train.py vs batched path", xlabel="round", ylabel="dist(B_t, B*)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "engine_spec004_dist.png", dpi=110)
    plt.close(fig)
    header = ["method", "rounds", "dist_B (train.py)", "dist_B (batched)", "max |gap|",
              f"new-client err n={per} (train.py)", "(batched)", "wall_s"]  # fmt: skip
    return [f"Engine path: train.py with configs/representation/linear_*.yaml (M={n}, float64; {count} new clients "
            f"fine-tuned 200 GD steps on {per} samples)", format_table(header, rows), ""]  # fmt: skip


# ---- FedRep (spec 000) ------------------------------------------------------------------------------------
METHODS = (("FedRep", None), ("10GD-GD", 10), ("GD-GD", 1))


def fedrep_fig3(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    plt = _plt()
    ns, trials, rounds = cfg["fig3_n"], cfg["trials"], cfg["fig3_rounds"]
    fig, axes = plt.subplots(2, len(ns), figsize=(4 * len(ns), 7), squeeze=False)
    rows = []
    for j, n in enumerate(ns):
        tasks = fr.make_tasks(trials, n, 5, 10, 2, 1e-3, gen(20, j))
        inits = {
            "projected-GD init": fr.projected_gd_init(tasks.x, tasks.y, 2),
            "random init": (fr.random_init(trials, 10, 2, gen(21, j)), torch.zeros(trials, 1, 2, dtype=F64)),
        }
        for i, (init_name, (b0, w0)) in enumerate(inits.items()):
            for name, steps in METHODS:
                run = fr.fedrep(
                    tasks, b0, w0, rounds, 0.1, steps, 0.1, max(1, n // 10), generator=gen(22, j), track_fvalue=False
                )
                med = run.dist.median(1).values
                axes[i, j].semilogy(med, label=name)
                ts = [t for t in (0, 50, 100, rounds) if t <= rounds]
                rows.append((init_name, n, name, *[float(med[t]) for t in ts]))
                for t in ts:
                    records.append(
                        record("fedrep_fig3", name, f"median_dist@{t}", float(med[t]), setting=f"n={n},{init_name}")
                    )
            axes[i, j].set(title=f"n={n}, {init_name}", xlabel="round", ylabel="dist(B_t, B*)")
            axes[i, j].legend(fontsize=8)
    fig.suptitle(f"FedRep Fig. 3: d=10, k=2, m=5, r=0.1, η=0.1 (median of {trials} trials)")
    fig.tight_layout()
    fig.savefig(out / "fedrep_fig3_dist.png", dpi=110)
    plt.close(fig)
    ts = [t for t in (0, 50, 100, rounds) if t <= rounds]
    return [f"FedRep Fig. 3: median dist(B_t, B*) over {trials} trials (d=10, k=2, m=5, r=0.1)",
            format_table(["init", "n", "method", *[f"t={t}" for t in ts]], rows), ""]  # fmt: skip


def fedrep_fig7(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    plt = _plt()
    ms, ns, trials, rounds = cfg["fig7_m"], cfg["fig7_n"], cfg["trials"], cfg["fig7_rounds"]
    fig, axes = plt.subplots(len(ms), len(ns), figsize=(3.6 * len(ns), 3 * len(ms)), squeeze=False)
    rows, ts = [], sorted({min(10, rounds), min(50, rounds), rounds})
    for i, m in enumerate(ms):
        for j, n in enumerate(ns):
            tasks = fr.make_tasks(trials, n, m, 10, 2, 1e-3, gen(30, i, j))
            b0, w0 = fr.projected_gd_init(tasks.x, tasks.y, 2)
            finals, means = {}, {}
            for name, steps in (("FedRep", None), ("GD-GD", 1)):
                run = fr.fedrep(tasks, b0, w0, rounds, 0.1, steps, 0.1)
                mean, half = run.fvalue.mean(1), ci95(run.fvalue, 1)
                axes[i, j].semilogy(mean, label=name)
                axes[i, j].fill_between(range(rounds + 1), (mean - half).clamp(min=1e-12), mean + half, alpha=0.3)
                finals[name], means[name] = (float(mean[-1]), float(half[-1])), mean
                records.append(record("fedrep_fig7", name, f"F@{rounds}", finals[name][0], setting=f"m={m},n={n}"))
                records.append(record("fedrep_fig7", name, f"F@{rounds}_ci95", finals[name][1], setting=f"m={m},n={n}"))
            ratios = [float(means["GD-GD"][t] / means["FedRep"][t]) for t in ts]
            for t, ratio in zip(ts, ratios):
                records.append(record("fedrep_fig7", "GD-GD/FedRep", f"F_ratio@{t}", ratio, setting=f"m={m},n={n}"))
            rows.append((m, n, *[f"{finals[k][0]:.3g} ± {finals[k][1]:.2g}" for k in ("FedRep", "GD-GD")], *ratios))
            axes[i, j].set(title=f"m={m}, n={n}", xlabel="round", ylabel="F(W_t, B_t)")
            axes[i, j].legend(fontsize=8)
    fig.suptitle(f"FedRep Fig. 7: F(W, B), r=1, d=10, k=2, mean ± 95% CI of {trials} trials")
    fig.tight_layout()
    fig.savefig(out / "fedrep_fig7_fvalue.png", dpi=110)
    plt.close(fig)
    return [f"FedRep Fig. 7: F(W_T, B_T) at T={rounds}, mean ± 95% CI ({trials} trials, r=1)",
            format_table(["m", "n", f"FedRep F@{rounds}", f"GD-GD F@{rounds}", *[f"ratio@{t}" for t in ts]], rows),
            ""]  # fmt: skip


def fedrep_fig1_fig4(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    plt = _plt()
    trials, n, d, k, rounds = cfg["trials"], 100, 20, 2, cfg["fig1_rounds"]
    rows, reps = [], {}
    errors: dict[str, list[float]] = {"Local Only": [], "FedSGD": [], "FedRep": []}
    for m in cfg["fig1_m"]:
        tasks = fr.make_tasks(trials, n, m, d, k, 1e-3, gen(40, m))
        b0 = fr.random_init(trials, d, k, gen(41, m))
        rep = fr.fedrep(tasks, b0, torch.zeros(trials, 1, k, dtype=F64), rounds, 0.1, track_fvalue=False)
        sgd = fa.fedavg(b0, torch.zeros(trials, k, dtype=F64), fa.sample_objectives(tasks.x, tasks.y), 0.1, 1, rounds)
        reps[m] = (tasks, rep, sgd)
        err = {
            "Local Only": fr.squared_error(fr.local_only(tasks.x, tasks.y), tasks.theta_star).mean(1),
            "FedSGD": fr.squared_error(torch.einsum("tdk,tk->td", sgd.b, sgd.w)[:, None], tasks.theta_star).mean(1),
            "FedRep": fr.squared_error(torch.einsum("tdk,tnk->tnd", rep.b, rep.w), tasks.theta_star).mean(1),
        }
        for name, e in err.items():
            errors[name].append(float(e.mean()))
            records.append(record("fedrep_fig1", name, "test_mse", float(e.mean()), setting=f"m={m},n=100,d=20,k=2"))
        rows.append((m, *[float(err[name].mean()) for name in errors]))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.25
    for i, (name, vals) in enumerate(errors.items()):
        ax.bar([x + (i - 1) * width for x in range(len(cfg["fig1_m"]))], vals, width, label=name)
    ax.set_xticks(range(len(cfg["fig1_m"])))
    ax.set_xticklabels([f"m={m}" for m in cfg["fig1_m"]])
    ax.set(yscale="log", ylabel="test MSE (noise-free, ‖θ̂ − θ*‖²)", title="FedRep Fig. 1: n=100, d=20, k=2, r=1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fedrep_fig1_errors.png", dpi=110)
    plt.close(fig)
    lines = [f"FedRep Fig. 1: clients' test MSE ‖θ̂ᵢ − θᵢ*‖² (n=100, d=20, k=2, {rounds} rounds, {trials} trials)",
             format_table(["m", *errors], rows), ""]  # fmt: skip

    m_train = 10 if 10 in reps else cfg["fig1_m"][0]
    tasks, rep, sgd = reps[m_train]
    curves: dict[str, list[tuple[float, float]]] = {"Local Only": [], "FedSGD": [], "FedRep": []}
    rows = []
    for m_new in cfg["fig4_m_new"]:
        x, y, theta = fr.new_clients(tasks.b_star, m_new, 100, 1e-3, gen(42, m_new))
        per_client = {
            "Local Only": fr.squared_error(fr.local_only(x, y), theta),
            "FedSGD": fr.head_on_representation_error(sgd.b, x, y, theta),
            "FedRep": fr.head_on_representation_error(rep.b, x, y, theta),
        }
        for name, e in per_client.items():
            curves[name].append((float(e.median()), float(e.mean())))
            for stat, v in zip(("median", "mean"), curves[name][-1]):
                records.append(
                    record(
                        "fedrep_fig4", name, f"new_client_mse_{stat}@m_new={m_new}", v, setting=f"trained m={m_train}"
                    )
                )
        rows.append((m_new, *[f"{curves[name][-1][0]:.3g} / {curves[name][-1][1]:.3g}" for name in curves]))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, vals in curves.items():
        line = ax.semilogy(cfg["fig4_m_new"], [v for v, _ in vals], marker="o", label=f"{name} (median)")[0]
        ax.semilogy(cfg["fig4_m_new"], [v for _, v in vals], ls=":", color=line.get_color(), label=f"{name} (mean)")
    ax.axvline(k, color="gray", ls=":", label="k")
    ax.axvline(d, color="gray", ls="--", label="d")
    ax.set(
        xscale="log",
        xlabel="new-client samples m_new",
        ylabel="new-client MSE",
        title="FedRep Fig. 4 (n=100, d=20, k=2)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fedrep_fig4_new_clients.png", dpi=110)
    plt.close(fig)
    lines += [f"FedRep Fig. 4: new-client MSE median / mean (100 new clients × trials; trained with m={m_train})",
              format_table(["m_new", *curves], rows), ""]  # fmt: skip
    return lines


def fedrep_init(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    plt = _plt()
    rows, pts = [], {"Method of Moments": [], "projected GD (10 steps)": []}
    for n in cfg["init_n"]:
        for m in (5, 20):
            tasks = fr.make_tasks(cfg["trials"], n, m, 10, 2, 1e-3, gen(50, n, m))
            mom = float(fa.distance(tasks.b_star, fr.method_of_moments_init(tasks.x, tasks.y, 2)).median())
            pgd = float(fa.distance(tasks.b_star, fr.projected_gd_init(tasks.x, tasks.y, 2)[0]).median())
            pts["Method of Moments"].append((n * m, mom))
            pts["projected GD (10 steps)"].append((n * m, pgd))
            rows.append((n, m, n * m, mom, pgd))
            records.append(record("fedrep_init", "Method of Moments", "median_dist_B0", mom, setting=f"n={n},m={m}"))
            records.append(record("fedrep_init", "projected GD", "median_dist_B0", pgd, setting=f"n={n},m={m}"))
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, p in pts.items():
        p = sorted(p)
        ax.loglog([a for a, _ in p], [b for _, b in p], marker="o", label=name)
    ax.set(xlabel="total samples n·m", ylabel="median dist(B⁰, B*)", title="Initialisations (d=10, k=2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fedrep_init.png", dpi=110)
    plt.close(fig)
    return ["FedRep initialisations: median dist(B⁰, B*) (d=10, k=2)",
            format_table(["n", "m", "n·m", "MoM", "projected GD"], rows), ""]  # fmt: skip


def fedrep_engine(cfg: dict[str, Any], out: Path, records: list[dict[str, Any]]) -> list[str]:
    """train.py with configs/representation/fedrep*.yaml (random init) for several seeds, and the batched path
    replayed on the same data, initialisation and client cohorts."""
    from fl_lightning.engine.rounds import ClientSampler

    plt = _plt()
    seeds, rounds, data = cfg["engine_seeds000"], cfg["engine_rounds000"], cfg["engine_data000"]
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 4), squeeze=False)
    rows = []
    for j, seed in enumerate(seeds):
        dm, net = _engine_setup("fedrep_base", seed, data)
        fed = dm.federated
        n, m = fed.num_clients, int(fed.train.sizes[0])
        tasks = fr.Tasks(fed.train.x.reshape(1, n, m, -1), fed.train.y.reshape(1, n, m),
                         fed.extras["B_star"][None], fed.extras["W_star"][None])  # fmt: skip
        b0, w0 = net.body.weight.detach().T.double()[None], torch.zeros(1, 1, dm.rank, dtype=F64)  # head_init: zeros
        cohorts = ClientSampler(n, dm.clients_per_round, seed).sample
        for name, label, steps in (("fedrep", "FedRep", None), ("10gdgd", "10GD-GD", 10), ("gdgd", "GD-GD", 1)):
            run_dir = out / "runs" / f"{name}_seed{seed}"
            summary = train_config(
                [CONFIGS / "fedrep_base.yaml", CONFIGS / f"{name}.yaml"],
                [f"--seed_everything={seed}", f"--trainer.max_steps={rounds}", "--trainer.enable_checkpointing=false",
                 *_flags(data)],
                run_dir=run_dir,
            )  # fmt: skip
            hist = engine_history(run_dir)
            replay = fr.fedrep(tasks, b0, w0, rounds, 0.1, steps, 0.1, cohorts=cohorts).dist[:, 0]
            gap = max(abs(v - float(replay[t])) for t, v in hist)
            line = axes[0, j].semilogy([t for t, _ in hist], [v for _, v in hist], marker="o", ls="", label=label)
            axes[0, j].semilogy(replay, color=line[0].get_color(), lw=1)
            rows.append((seed, label, summary["dist_B"], float(replay[-1]), gap, summary["final"], summary["wall_s"]))
            setting = f"train.py, n={n}, seed={seed}"
            records.append(
                record("engine_fedrep", label, "dist_B_final", summary["dist_B"], seed=seed, setting=setting)
            )
            records.append(record("engine_fedrep", label, "max_gap_to_batched", gap, seed=seed, setting=setting))
        axes[0, j].set(title=f"seed {seed}: train.py (dots) vs batched (lines)", xlabel="round", ylabel="dist(B_t, B*)")
        axes[0, j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "engine_fedrep_dist.png", dpi=110)
    plt.close(fig)
    header = ["seed", "method", "dist_B (train.py)", "dist_B (batched)", "max |gap|", "client mse", "wall_s"]
    return [f"Engine path: train.py with configs/representation/fedrep*.yaml (random init, {rounds} rounds)",
            format_table(header, rows), ""]  # fmt: skip


# ---- spec 004 §4.2: CIFAR-100 transfer --------------------------------------------------------------------
def cifar_transfer(
    data_dir: Path, out: Path, overrides: list[str], finetune_epochs: int = 10, finetune_samples: int | None = 50
) -> list[dict[str, Any]]:
    """Train FedAvg τ=50 and D-SGD τ=1 with the CIFAR-100 transfer configs, fine-tune every new client (classes
    80–99) from the last checkpoint and record top-1 accuracy and the per-class feature |cos| (spec 004 §4.2)."""
    import yaml

    from datamodules import CIFAR100DataModule
    from datamodules.partition import Shards
    from experiments.linear_representation.features import class_feature_cosine, mean_offdiagonal, per_class_features
    from experiments.linear_representation.transfer import evaluate_new_clients
    from fl_lightning.models import TransferCNN

    # the new clients depend only on the data, the seed and the transfer settings of cifar100_transfer.yaml
    dm = CIFAR100DataModule(
        num_clients=16, data_dir=str(data_dir), partition=Shards(5), transfer_classes=list(range(80, 100)),
        transfer_clients=5, write_report=False, seed=0,
    )  # fmt: skip
    dm.setup()
    new = dm.new_clients
    records = []
    for name, label in (("cifar100_fedavg_tau50", "FedAvg τ=50"), ("cifar100_dsgd_tau1", "D-SGD τ=1")):
        run_dir = out / "runs" / name
        rounds = _override(
            overrides,
            "trainer.max_steps",
            yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["trainer"]["max_steps"],
        )
        summary = train_config(
            [CONFIGS / "cifar100_transfer.yaml", CONFIGS / f"{name}.yaml"],
            [f"--data.init_args.data_dir={data_dir}", f"--checkpoint_every={rounds}", *overrides],
            run_dir=run_dir,
        )
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        net_args = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["network"]["init_args"]
        net = TransferCNN(**{k: tuple(v) if isinstance(v, list) else v for k, v in net_args.items()})
        net.load_state_dict({k[len("net.") :]: v for k, v in ckpt["state_dict"].items() if k.startswith("net.")})
        hp = ckpt["hyper_parameters"]
        acc = evaluate_new_clients(
            net, new, finetune_epochs, hp["lr"], hp["momentum"], hp["weight_decay"], hp["batch_size"],
            finetune_samples=finetune_samples,
        )  # fmt: skip
        per_class = min(25, int(torch.bincount(new.test.y).min()))
        feats = per_class_features(net, new.test.x, new.test.y, list(range(20)), per_class)
        sim = mean_offdiagonal(class_feature_cosine(feats))
        records.append(record("spec004_cifar100", label, "train_acc_mean", summary["final"]))
        records.append(record("spec004_cifar100", label, "new_client_acc", float(acc.nanmean()),
                              setting=f"fresh head, {finetune_samples} samples, {finetune_epochs} epochs"))  # fmt: skip
        if "new_clients_acc" in summary:
            records.append(record("spec004_cifar100", label, "engine_new_clients_acc", summary["new_clients_acc"],
                                  setting="train.py new_client_finetune (all training samples)"))  # fmt: skip
        records.append(record("spec004_cifar100", label, "feature_abs_cos", sim, setting=f"{per_class} images/class"))
    return records


def _override(overrides: list[str], key: str, default: int) -> int:
    for o in overrides:
        if o.startswith(f"--{key}="):
            return int(o.split("=", 1)[1])
    return default


# ---- main -------------------------------------------------------------------------------------------------
FULL = dict(
    settings004={"T1": (10, 2, 20), "T2": (50, 5, 40)}, fig6=(50, 5, 40, 10),
    trials=10, rounds004=1000, ft_samples=[5, 10, 20, 50, 100], sweep_trials=5, taus=[1, 2, 3, 5, 10],
    alphas=[0.1, 0.2, 0.4], sweep_rounds=300, alpha_rounds=3000, engine_rounds004=500, engine_data004={},
    fig3_n=[10, 100, 1000, 10000], fig3_rounds=200, fig7_m=[5, 10, 20], fig7_n=[10, 100, 1000], fig7_rounds=200,
    fig1_m=[5, 10, 20], fig1_rounds=500, fig4_m_new=[1, 2, 5, 10, 20, 40], init_n=[10, 100, 1000, 10000],
    engine_rounds000=200, engine_data000={}, engine_seeds000=[0, 1, 2],
)  # fmt: skip
QUICK = dict(
    settings004={"T1": (10, 2, 20)}, fig6=(10, 2, 20, 5),
    trials=2, rounds004=60, ft_samples=[5, 20], sweep_trials=2, taus=[1, 2], alphas=[0.2, 0.4], sweep_rounds=60,
    alpha_rounds=60, engine_rounds004=4, engine_data004={"num_clients": 4, "new_clients": 2}, fig3_n=[10, 100],
    fig3_rounds=20, fig7_m=[5], fig7_n=[10, 100], fig7_rounds=20, fig1_m=[5, 10], fig1_rounds=20,
    fig4_m_new=[1, 2, 40], init_n=[10, 100], engine_rounds000=4, engine_data000={"num_clients": 10},
    engine_seeds000=[0],
)  # fmt: skip


PARTS = {f.__name__: f for f in (spec004, spec004_engine, fedrep_fig3, fedrep_fig7, fedrep_fig1_fig4, fedrep_init,
                                  fedrep_engine)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments representation", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test of every figure)")
    parser.add_argument("--trials", type=int, default=None, help="override the number of trials (default 10)")
    parser.add_argument("--out", type=Path, default=Path("results/representation"))
    parser.add_argument("--cifar-data", type=Path, default=None, help="CIFAR-100 folder: also run spec 004 §4.2")
    parser.add_argument("--spec004", action="append", default=None, metavar="D,K,M",
                        help="spec 004 setting(s) for the batched figures instead of T1/T2 (repeatable)")  # fmt: skip
    parser.add_argument("--engine004", default=None, metavar="D,K,M", help="the train.py runs' d, k, M (default T1)")
    parser.add_argument("--parts", default=None, help=f"comma list of parts to run (default all: {', '.join(PARTS)})")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dict(QUICK if args.quick else FULL)
    if args.trials is not None:
        cfg["trials"] = args.trials
    if args.spec004:
        cfg["settings004"] = {f"S{i + 1}": tuple(int(v) for v in s.split(",")) for i, s in enumerate(args.spec004)}
    if args.engine004:
        d, k, num = (int(v) for v in args.engine004.split(","))
        cfg["engine_data004"] = {**cfg["engine_data004"], "dim": d, "rank": k, "num_clients": num}
    parts = [PARTS[p] for p in args.parts.split(",")] if args.parts else list(PARTS.values())
    args.out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    for part in parts:
        t0 = time.perf_counter()
        lines = part(cfg, args.out, records)
        print("\n".join(lines))
        print(f"[{part.__name__}: {time.perf_counter() - t0:.1f} s]\n")
    if args.cifar_data is not None:
        cifar = cifar_transfer(args.cifar_data, args.out, [])
        records += cifar
        print(format_table(["method", "metric", "value"], [(r["method"], r["metric"], r["value"]) for r in cifar]))
    print(f"total wall time: {time.perf_counter() - start:.1f} s")
    print(f"plots: {args.out}/*.png")
    print(f"results: {write_results(records, args.out)}")
    return 0
