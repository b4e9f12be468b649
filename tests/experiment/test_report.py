"""``fl_lightning/experiment/report.py``: the comparison table on run results written here: "+FT" figures in their own
columns and records, the at-chance and below-Local-only flags, the one-class flag, and the chance threshold."""

from __future__ import annotations

import pytest

from fl_lightning.experiment.collect import RunResult
from fl_lightning.experiment.report import at_chance, make_table, results_records
from fl_lightning.results import reported_figure


def run(method: str, seed: int, algorithm: str, **summary: float) -> RunResult:
    return RunResult("exp", {"method": method}, seed, {"algorithm": algorithm, "metric": "acc", **summary})



def test_report_puts_finetuned_figures_in_their_own_columns() -> None:
    runs = [
        run("fedavg", 0, "FedAvg", last10=0.50, classes=10),
        run("fedavg", 1, "FedAvg", last10=0.60, classes=10),
        run("fedavg_ft", 0, "FedAvg+FT", last10=0.50, final_ft=0.90, classes=10),
        run("fedavg_ft", 1, "FedAvg+FT", last10=0.60, final_ft=0.80, classes=10),
    ]
    table = make_table(runs, ["method"], ["last10"])
    assert table.metrics == ["last10", "final_ft"]
    rows = {labels[0]: cells for labels, cells, _ in table.rows}
    assert rows["fedavg_ft"]["last10"].mean == pytest.approx(0.55)  # the plain run, as FedAvg's
    assert rows["fedavg_ft"]["final_ft"].mean == pytest.approx(0.85)
    assert rows["fedavg"]["final_ft"].values == []
    text = table.formatted("md")
    assert "| fedavg_ft | 55.00 ± 7.07" in text and "85.00 ± 7.07" in text
    names = {(r["method"], r["metric"]) for r in results_records(runs) if r.get("seed") == 0}
    assert ("fedavg_ft", "acc_last10") in names and ("fedavg_ft", "final_ft") in names
    assert make_table(runs[:2], ["method"], ["last10"]).metrics == ["last10"]  # no "+FT" run, no extra column
    assert reported_figure(runs[2].summary) == 0.90 and reported_figure(runs[0].summary) == 0.50



def test_report_flags_runs_at_chance_and_methods_below_local_only() -> None:
    runs = [
        run("local", 0, "LocalOnly", last10=0.80, classes=10),
        run("local", 1, "LocalOnly", last10=0.84, classes=10),
        run("fedrep", 0, "FedRep", last10=0.95, classes=10),
        run("fedavg", 0, "FedAvg", last10=0.70, classes=10),
        run("moon", 0, "MOON", last10=0.11, classes=10),  # chance 0.10; 0.10 + 0.05·0.9 = 0.145
        run("moon", 1, "MOON", last10=0.30, classes=10),
    ]
    table = make_table(runs, ["method"], ["last10"])
    assert table.flags == {
        ("fedavg",): "below Local-only (70.00 < 82.00)",
        ("moon",): "at chance (1/2 runs); below Local-only (20.50 < 82.00)",
    }
    text = table.formatted("md")
    assert "flags" in text.splitlines()[0]
    moon = next(line for line in text.splitlines() if line.startswith("| moon"))
    assert "at chance (1/2 runs)" in moon and moon.rstrip(" |").endswith("2")
    assert "flags" in table.formatted("csv").splitlines()[0]
    assert not make_table(runs[:3], ["method"], ["last10"]).flags  # nothing wrong: no flags column
    assert "flags" not in make_table(runs[:3], ["method"], ["last10"]).formatted("md").splitlines()[0]



def test_report_flags_runs_whose_models_predict_one_class() -> None:
    runs = [
        run("moon", 0, "MOON", last10=0.30, classes=10, top_class_share=0.97, label_top_class_share=0.12),
        run("moon", 1, "MOON", last10=0.60, classes=10, top_class_share=0.40, label_top_class_share=0.12),
        run("skewed", 0, "FedAvg", last10=0.9, classes=10, top_class_share=0.95, label_top_class_share=0.95),
        run("old", 0, "FedAvg", last10=0.9, classes=10),  # a summary from before the check: no claim
    ]
    table = make_table(runs, ["method"], ["last10"])
    assert table.flags == {("moon",): "predicts one class (1/2 runs)"}
    assert "'predicts one class' = at least 90%" in table.formatted("md")



def test_at_chance_threshold_scales_with_the_number_of_classes() -> None:
    assert at_chance(run("m", 0, "X", last10=0.52, classes=2))  # 0.5 + 0.05·0.5 = 0.525
    assert not at_chance(run("m", 0, "X", last10=0.53, classes=2))
    assert at_chance(run("m", 0, "X", last10=0.059, classes=100)) and not at_chance(run("m", 0, "X", last10=0.06,
                                                                                          classes=100))
    assert not at_chance(run("m", 0, "X", last10=0.01))  # the number of classes unknown: no claim
