"""``make bench``'s ``methods_cnn`` workload in its quick mode on tiny sizes: the printed table's structure, the
records, and that every method listed ran both the sequential reference and ``model.executor: auto``."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench
from fl_lightning import algorithms

TINY = ["--device", "cpu", "--quick", "--clients", "3", "--samples", "4", "--rounds", "1", "--workloads", "methods_cnn"]


def run_methods(tmp_path, capsys, *extra: str) -> tuple[list[list[str]], list[dict], str]:
    """Run the workload; the methods table's rows (split cells), results.json's rows, and stdout."""
    assert bench.main([*TINY, "--out", str(tmp_path), *extra]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = max(i for i, line in enumerate(lines) if line.split()[:2] == ["method", "auto"])
    assert lines[head].split() == "method auto path sequential s/round auto s/round seq/auto seq / FedAvg seq".split()
    rows = []
    for line in lines[head + 2 :]:
        if not line or line.startswith(" "):
            break
        rows.append(line.split())
    return rows, json.loads((tmp_path / "results.json").read_text()), out


def check_rows(rows: list[list[str]], records: list[dict], methods: list[str]) -> None:
    assert [r[0] for r in rows] == methods
    for name, path, seq, auto, ratio, over_fedavg in rows:
        assert path in ("stacked", "sequential")
        seq, auto, ratio, over_fedavg = map(float, (seq, auto, ratio, over_fedavg))
        assert all(math.isfinite(v) and v > 0 for v in (seq, auto, ratio, over_fedavg))
        # the ratio columns are the printed seconds' ratios (4 significant digits in the table)
        assert ratio == pytest.approx(seq / auto, rel=0.05, abs=1e-3)
        times = {r["method"]: r["value"] for r in records if r["metric"] == "train_s_per_round"}
        assert times[f"{name} sequential"] > 0 and times[f"{name} auto"] > 0  # both paths ran
    fedavg = rows[0]
    assert fedavg[0] == "FedAvg" and float(fedavg[5]) == pytest.approx(1.0)
    reference = {r["method"]: r["value"] for r in records if r["metric"] == "fedavg_seq_s_per_round"}
    assert reference["FedAvg sequential"] == pytest.approx(float(fedavg[2]), rel=1e-3, abs=1e-4)  # its own loop
    for row in rows:  # the last column: this method's loop over FedAvg's loop timed in the same turns
        assert float(row[5]) == pytest.approx(float(row[2]) / reference[f"{row[0]} sequential"], rel=0.05, abs=1e-3)
    ratios = {r["method"]: r["value"] for r in records if r["metric"] == "seq_over_fedavg_seq"}
    assert set(ratios) == {f"{m} sequential" for m in methods}


def test_methods_cnn_quick_subset(tmp_path, capsys):
    rows, records, out = run_methods(tmp_path, capsys, "--methods", "FedRep", "FedALA")
    check_rows(rows, records, ["FedAvg", "FedRep", "FedALA"])  # FedAvg first: the last column's reference
    paths = {r[0]: r[1] for r in rows}
    assert paths["FedRep"] == "stacked" and paths["FedALA"] == "sequential"  # not vectorizable: the loop
    assert "arithmetic-bound" in out


def test_gradient_algorithms_rule():
    found = bench.gradient_algorithms()
    closed_form = {"LinearFedAvg", "LinearFedRep", "AlternatingGD", "IFCA", "FedMD", "OneShotClustering",
                   "PowerInitLocalGD"}  # fmt: skip
    exported = {n for n in algorithms.__all__ if n not in ("Algorithm", "ClientUpdate")}
    assert set(found) == exported - closed_form


@pytest.mark.slow
def test_methods_cnn_quick_every_method(tmp_path, capsys):
    rows, records, out = run_methods(tmp_path, capsys)
    methods = [r[0] for r in rows]
    skipped = [m for m in bench.gradient_algorithms() if f"  {m} skipped: " in out]
    assert skipped == ["FedBN"]  # FedBN needs BatchNorm, FedAvgCNN has none
    listed = ["FedAvg", *(m for m in bench.gradient_algorithms() if m not in ("FedAvg", "FedBN"))]
    check_rows(rows, records, listed)
    assert methods == listed
