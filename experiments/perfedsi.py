"""PerFedSI (spec 002): synthetic matrix completion, the linear bias toy, and the digits feature-shift stand-in.

``python -m experiments perfedsi [--seeds 3] [--rounds 100] [--out results/perfedsi]`` runs

1. federated inductive matrix completion (Figure 3 setting: d=16, M=20, k=4, r=2, 5 observed items per client,
   τ=10 local steps with fresh items, 4 clients per round with replacement, η=0.5) with side information, with
   one-hot client ids (the original problem) and with one shared prediction; ``imc_error.png``;
2. the App. B linear toy with and without side information, per-client bias error against the closed-form
   floor ``(b_m − b̄)²``; ``toy_floor.png``;
3. the digits stand-in for the CIFAR setting as an experiment file run by the generic runner
   (``configs/experiments/perfedsi_digits.yaml``: ``configs/perfedsi/digits.yaml``, four shift groups, one-hot z,
   fixed mask after conv-3; PerFedSI with conv-4 BatchNorm statistics shared, the paper read literally, and per
   side-information group, our option, vs FedAvg, SR-PH and PR-SH, 3 seeds; ``--methods`` adds Ditto, Local, the
   learned mask). Run dirs go to ``runs/perfedsi-digits/`` (finished ones are reused), the table is mean ± std over
   seeds, the report (curves, per-client accuracies, ``results.json``) goes to ``<out>/digits/``.

``--setting cifar10_m100`` (or any ``configs/perfedsi/<setting>.yaml``) instead runs PerFedSI and every baseline
on that real-data setting (its data must be on disk) with the same runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np

from experiments import ROOT
from experiments.side_information import federated_imc, imc_problem, linear_bias_toy
from fl_lightning.errors import ConfigError
from fl_lightning.experiment.report import results_records
from fl_lightning.experiment.runner import run_experiment
from fl_lightning.experiment.spec import Experiment, load_experiment, parse_experiment
from fl_lightning.results import format_table, record, write_results

CONFIGS = ROOT / "configs" / "perfedsi"
METHODS = {
    "PerFedSI": "perfedsi_mask.yaml",
    "PerFedSI (side BN)": "perfedsi_mask_sidebn.yaml",
    "PerFedSI (learned mask)": "perfedsi_mask_learned.yaml",
    "PerFedSI (concat)": "perfedsi_concat.yaml",
    "FedAvg": "fedavg.yaml",
    "SR-PH": "srph.yaml",
    "PR-SH": "prsh.yaml",
    "Ditto": "ditto.yaml",
    "Local": "local.yaml",
}
LABELS = {
    "PerFedSI": "perfedsi",
    "PerFedSI (side BN)": "perfedsi_sidebn",
    "PerFedSI (learned mask)": "perfedsi_learned",
    "PerFedSI (concat)": "perfedsi_concat",
    "FedAvg": "fedavg",
    "SR-PH": "srph",
    "PR-SH": "prsh",
    "Ditto": "ditto",
    "Local": "local",
}
DEFAULT_DIGITS = ["PerFedSI", "PerFedSI (side BN)", "FedAvg", "SR-PH", "PR-SH"]
EXPERIMENT = ROOT / "configs" / "experiments" / "perfedsi_digits.yaml"
IMC_VARIANTS = {"given": "with side information", "one_hot": "no SI: one-hot ids", "none": "no SI: shared"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- 1. matrix completion -------------------------------------------------------------------------------
def run_imc(seeds: int, rounds: int, out: Path, records: list) -> list[tuple[str, bool]]:
    curves: dict[str, list[np.ndarray]] = {v: [] for v in IMC_VARIANTS}
    for seed in range(seeds):
        problem = imc_problem(seed=seed)
        for variant in IMC_VARIANTS:
            err = federated_imc(problem, variant, rounds=rounds, seed=seed)
            curves[variant].append(err)
            records.append(record("imc", variant, "final_error", err[-1], seed, f"d=16,M=20,k=4,r=2,T={rounds}"))
    rows = []
    for seed in range(seeds):
        rows.append([seed, *(float(curves[v][seed][-1]) for v in IMC_VARIANTS)])
    print(f"\nFederated matrix completion (spec 002 §3.3): L(U, V) after {rounds} rounds")
    print(format_table(["seed", *IMC_VARIANTS.values()], rows))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (variant, label), color in zip(IMC_VARIANTS.items(), ("C0", "C3", "C7")):
        for seed, err in enumerate(curves[variant]):
            ax.semilogy(err, color=color, alpha=0.8, label=label if seed == 0 else None)
    ax.set_xlabel("communication round")
    ax.set_ylabel("(1/2M)·||U Vᵀ Zᵀ − L*||²")
    ax.set_title(f"Federated IMC, d=16 M=20 k=4 r=2, {seeds} seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "imc_error.png", dpi=120)
    plt.close(fig)
    final = {v: [c[-1] for c in cs] for v, cs in curves.items()}
    return [
        (f"with SI below 1e-5 on every seed (max {max(final['given']):.1e})", max(final["given"]) < 1e-5),
        (
            "without SI ≥ 100× the with-SI error on every seed (one-hot ids and shared prediction)",
            all(final[v][s] >= 100 * final["given"][s] for v in ("one_hot", "none") for s in range(seeds)),
        ),
    ]


# ---- 2. linear toy --------------------------------------------------------------------------------------
def run_toy(seeds: int, out: Path, records: list) -> list[tuple[str, bool]]:
    rows, checks, points = [], [], []
    for seed in range(seeds):
        for participation, cpr in (("full", 50), ("20%", 10)):
            without = linear_bias_toy(False, clients_per_round=cpr, seed=seed)
            with_si = linear_bias_toy(True, clients_per_round=cpr, seed=seed)
            floor = without.bias_floor
            setting = f"d=10,M=50,n=100,k=3,clients/round={cpr}"
            for method, res in (("FedAvg (no SI)", without), ("PerFedSI", with_si)):
                records.append(record("linear_toy", method, "mean_excess_risk", res.excess_risk.mean(), seed, setting))
                records.append(record("linear_toy", method, "mean_bias_error", res.bias_error.mean(), seed, setting))
            records.append(record("linear_toy", "closed form", "mean_bias_floor", floor.mean(), seed, setting))
            rel = float(np.abs(without.bias_error - floor).max() / floor.max())
            rows.append(
                [seed, participation, float(floor.mean()), float(without.bias_error.mean()), rel,
                 float(with_si.excess_risk.max())]
            )  # fmt: skip
            if participation == "full":
                points.append((floor, without.bias_error, with_si.bias_error))
                checks.append((rel < 0.01, float(with_si.excess_risk.max()) < 1e-3))
    print("\nLinear toy (App. B): per-client bias error (b̂_m − b_m)² vs the closed-form floor (b_m − b̄)²")
    print(
        format_table(
            ["seed", "clients/round", "mean floor", "FedAvg mean bias err", "max |err−floor|/max floor",
             "PerFedSI max excess risk"],
            rows,
        )
    )  # fmt: skip
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for i, (floor, without, with_si) in enumerate(points):
        ax.scatter(floor, without, s=12, color="C3", label="FedAvg (no SI)" if i == 0 else None)
        ax.scatter(floor, np.maximum(with_si, 1e-12), s=12, color="C0", label="PerFedSI" if i == 0 else None)
    lim = max(p[0].max() for p in points)
    ax.plot([1e-4, lim], [1e-4, lim], "k--", lw=1, label="closed form (b_m − b̄)²")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("(b_m − b̄)²")
    ax.set_ylabel("final (b̂_m − b_m)²")
    ax.set_title("Linear toy, full participation, all seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "toy_floor.png", dpi=120)
    plt.close(fig)
    return [
        ("without SI every client sits on (b_m − b̄)² (within 1% of the largest floor)", all(c[0] for c in checks)),
        ("with SI every client's excess risk < 1e-3", all(c[1] for c in checks)),
    ]


# ---- 3. federated runs from configs, with the generic experiment runner -----------------------------------------
def setting_experiment(setting: str, methods: list[str], seeds: int, runs_dir: Path) -> Experiment:
    """``configs/experiments/perfedsi_digits.yaml`` for the digits stand-in's default methods, else the same
    grid built for ``configs/perfedsi/<setting>.yaml`` (run dirs ``runs/perfedsi-<setting>/<method>/...``)."""
    if setting == "digits" and methods == DEFAULT_DIGITS:
        experiment = load_experiment(EXPERIMENT, runs_dir=runs_dir)
    else:
        data = {
            "name": f"perfedsi-{setting.replace('_', '-')}",
            "description": f"PerFedSI on {setting}",
            "configs": [str(CONFIGS / f"{setting}.yaml")],
            "axes": {
                "method": {LABELS[m]: str(CONFIGS / METHODS[m]) for m in methods},
                "dataset": {"digits_shift" if setting == "digits" else setting: None},
            },
            "wandb": {"project": "fl_lightning"},
        }
        experiment = parse_experiment(data, source=f"experiments.perfedsi ({setting})", runs_dir=runs_dir)
    return experiment.with_seeds(range(seeds))


def run_setting(
    setting: str, methods: list[str], seeds: int, rounds: int | None, out: Path, records: list, runs_dir: Path
) -> dict[str, list[float]] | int:
    """Run the grid; print mean ± std over seeds; returns the last-10 accuracies per method (or an exit code)."""
    experiment = setting_experiment(setting, methods, seeds, runs_dir)
    extra = []
    if rounds is not None:  # other rounds are another experiment (its own run dirs and W&B group)
        experiment = dataclasses.replace(
            experiment, name=f"{experiment.name}-r{rounds}", description=f"{rounds} rounds (--rounds)"
        )
        extra.append(f"--trainer.max_steps={rounds}")
    result = run_experiment(experiment, extra, report_dir=out / setting)
    if result.code:
        return result.code
    display = {v: k for k, v in LABELS.items()}
    per_method: dict[str, list[float]] = {m: [] for m in methods}
    for r in result.results:
        per_method[display[r.axes["method"]]].append(float(r.summary["last10"]))
    records += results_records(result.results)
    return per_method


def digits_checks(acc: dict[str, list[float]]) -> list[tuple[str, bool]]:
    mean = {m: statistics.mean(v) for m, v in acc.items()}
    checks = []
    for variant in [m for m in mean if m.startswith("PerFedSI")]:
        p = mean[variant]
        for other in ("FedAvg", "SR-PH", "PR-SH"):
            if other in mean:
                word = "beats" if other == "FedAvg" else "≥"
                ok = p > mean[other] if other == "FedAvg" else p >= mean[other]
                checks.append((f"{variant} {word} {other} ({100 * p:.2f} vs {100 * mean[other]:.2f})", ok))
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments perfedsi", description=__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=None, help="federated rounds (default: the config's)")
    parser.add_argument("--imc-rounds", type=int, default=1000)
    parser.add_argument("--setting", default="digits", help="configs/perfedsi/<setting>.yaml (default digits)")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
    parser.add_argument("--skip-synthetic", action="store_true", help="only the federated runs")
    parser.add_argument("--out", type=Path, default=Path("results/perfedsi"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="root of the federated runs' dirs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)  # small models: threads only add contention on a shared 2-core machine

    records: list = []
    checks: list[tuple[str, bool]] = []
    if not args.skip_synthetic:
        checks += run_imc(args.seeds, args.imc_rounds, args.out, records)
        checks += run_toy(args.seeds, args.out, records)
    if args.methods is not None:
        methods = args.methods
    elif args.setting == "digits":
        methods = DEFAULT_DIGITS
    else:
        side_model = "PerFedSI (concat)" if args.setting.startswith("omniglot") else "PerFedSI"
        methods = [side_model, "FedAvg", "SR-PH", "PR-SH", "Ditto", "Local"]
    try:
        acc = run_setting(args.setting, methods, args.seeds, args.rounds, args.out, records, args.runs_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(acc, int):
        return acc
    if args.setting == "digits" and {"PerFedSI", "FedAvg"} <= set(acc):
        checks += digits_checks(acc)
    print()
    for text, ok in checks:
        print(f"[{'ok' if ok else 'FAIL'}] {text}")
    path = write_results(records, args.out)
    print(f"plots: {', '.join(sorted(str(p.relative_to(args.out)) for p in args.out.rglob('*.png')))}")
    print(f"results: {path}")
    return 0
