"""``python -m experiments leaderboard`` (issue 44) on a tiny experiment of the same shape (2 methods, 2 rounds,
2 seeds, 10 clients): the CSV's figures recomputed from the runs' summaries, a second run from a clean runs dir
writes the same CSV (``--check``), the ordering checks."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import yaml

from experiments import leaderboard

ROOT = Path(__file__).resolve().parents[2]


def tiny(tmp_path: Path) -> Path:
    data = {
        "name": "lb-tiny",
        "configs": [str(ROOT / "configs/leaderboard/base.yaml")],
        "tune": {"seeds": [100], "val_fraction": 0.25, "extend": 1},
        "axes": {
            "method": {
                "local": {"config": str(ROOT / "configs/digits/local.yaml"),
                          "tune": {"grid": {"model.lr": [0.05, 0.1]}}},
                "fedavg_ft": {"config": str(ROOT / "configs/digits/fedavg_ft.yaml"),
                              "tune": {"grid": {"model.lr": [0.05, 0.1]}, "metric": "final_ft"}},
            },
            "seed": [0, 1],
        },
        "set": {"trainer.max_steps": 2, "trainer.enable_progress_bar": False, "data.init_args.num_clients": 10},
        "wandb": {"mode": "disabled"},
    }  # fmt: skip
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
def test_the_leaderboard_is_recomputed_from_the_runs_and_a_clean_rerun_gives_the_same_csv(tmp_path):
    exp, docs = tiny(tmp_path), tmp_path / "docs"
    docs.mkdir()
    (docs / "leaderboard.md").write_text(f"# prose above\n\n{leaderboard.BEGIN}\nold\n{leaderboard.END}\nprose below\n")
    argv = ["--experiment", str(exp), "--docs", str(docs), "--no-timing", "--out", str(tmp_path / "out")]
    assert leaderboard.main([*argv, "--runs-dir", str(tmp_path / "runs1")]) == 0
    rows = list(csv.DictReader((docs / "leaderboard.csv").open()))
    assert [r["method"] for r in rows] == ["local", "fedavg_ft"]
    for row in rows:  # the reference: each final run's summary.json (+FT figures for fedavg_ft)
        ft = row["method"] == "fedavg_ft"
        summaries = [json.loads(p.read_text()) for p in (tmp_path / "runs1" / "lb-tiny" / row["method"]).glob(
            "s*/summary.json")]  # fmt: skip
        acc = [s["final_ft" if ft else "last10"] for s in summaries]
        worst = [s["final_ft_worst10" if ft else "final_worst10"] for s in summaries]
        assert len(summaries) == 2 and int(row["seeds"]) == 2
        assert float(row["acc_mean"]) == pytest.approx(statistics.fmean(acc), abs=1e-6)
        assert float(row["acc_std"]) == pytest.approx(statistics.stdev(acc), abs=1e-6)
        assert float(row["worst10_mean"]) == pytest.approx(statistics.fmean(worst), abs=1e-6)
        assert float(row["upload_bytes"]) == pytest.approx(summaries[0]["upload_bytes"])
    text = (docs / "leaderboard.md").read_text()
    assert text.startswith("# prose above\n") and text.endswith("prose below\n") and "old" not in text
    assert "| Local Only |" in text and "| FedAvg+FT |" in text and "trials)" in text
    assert (docs / "figures" / "leaderboard" / "leaderboard.png").stat().st_size > 0
    # a clean runs dir (every run trained again) reproduces the CSV byte for byte
    assert leaderboard.main([*argv, "--runs-dir", str(tmp_path / "runs2"), "--check"]) == 0
    (docs / "leaderboard.csv").write_text((docs / "leaderboard.csv").read_text().replace("local", "lokal"))
    assert leaderboard.main([*argv, "--runs-dir", str(tmp_path / "runs2"), "--check"]) == 1


def test_ordering_says_which_pairs_are_separated_by_two_standard_deviations():
    rows = [
        {"method": "fedrep", "acc_mean": 0.80, "acc_std": 0.01},
        {"method": "local", "acc_mean": 0.70, "acc_std": 0.02},
        {"method": "ditto", "acc_mean": 0.73, "acc_std": 0.02},
    ]
    lines = leaderboard.ordering(rows)
    assert lines == [
        "FedRep > Ditto (gap 7.00, 2 std 4.00)",
        "FedRep > Local Only (gap 10.00, 2 std 4.00)",
        "Ditto ≈ Local Only (gap 3.00, 2 std 4.00)",
    ]


def test_the_timing_run_gets_the_runs_training_arguments_only(tmp_path):
    """The CPU-seconds run trains what the leaderboard's run trained, in its own dir and without W&B."""
    from fl_lightning.experiment.spec import load_experiment

    run = next(r for r in load_experiment(tiny(tmp_path)).runs() if r.seed == 0)
    args = leaderboard.training_args(run.args())
    assert args == [*(a for c in run.configs for a in ("--config", c)), *run.overrides]
    assert "--run_dir" not in args and str(run.run_dir) not in args and not any("wandb" in a for a in args)
