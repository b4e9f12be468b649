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
    headers = "method auto path sequential s/round auto s/round seq/auto band verdict seq / FedAvg seq"
    assert lines[head].split() == headers.split()
    rows = []
    for line in lines[head + 2 :]:
        if not line or line.startswith(" "):
            break
        cells = line.split()  # the verdict "same path" is two words
        rows.append([*cells[:6], " ".join(cells[6:-1]), cells[-1]])
    return rows, json.loads((tmp_path / "results.json").read_text()), out


def check_rows(rows: list[list[str]], records: list[dict], methods: list[str]) -> None:
    assert [r[0] for r in rows] == methods
    for name, path, seq, auto, ratio, band, said, over_fedavg in rows:
        assert path in ("stacked", "sequential")
        seq, auto, ratio, over_fedavg = map(float, (seq, auto, ratio, over_fedavg))
        assert all(math.isfinite(v) and v > 0 for v in (seq, auto, ratio, over_fedavg))
        # one round: the median ratio is that round's, the printed seconds' ratio (4 significant digits), its band
        # that ratio alone
        assert ratio == pytest.approx(seq / auto, rel=0.05, abs=1e-3)
        low, high = map(float, band.split("-"))
        assert low == pytest.approx(ratio, abs=2e-3) and high == pytest.approx(ratio, abs=2e-3)
        mine = {r["metric"]: r for r in records if r["method"] == f"{name} auto"}
        exact = [mine[m]["value"] for m in ("seq_over_auto_low", "seq_over_auto", "seq_over_auto_high")]
        assert exact[0] <= exact[1] <= exact[2]
        assert f"path={path}" in mine["seq_over_auto"]["setting"]
        assert f"verdict={said.replace(' ', '_')}" in mine["seq_over_auto"]["setting"]
        if path == "sequential":  # auto runs the loop: its ratio is the loop against itself
            assert said == "same path"
        else:
            assert said == ("faster" if exact[0] > 1 else "slower" if exact[2] < 1 else "tie")
        times = {r["method"]: r["value"] for r in records if r["metric"] == "train_s_per_round"}
        assert times[f"{name} sequential"] > 0 and times[f"{name} auto"] > 0  # both paths ran
    fedavg = rows[0]
    assert fedavg[0] == "FedAvg" and float(fedavg[7]) == pytest.approx(1.0)
    reference = {r["method"]: r["value"] for r in records if r["metric"] == "fedavg_seq_s_per_round"}
    assert reference["FedAvg sequential"] == pytest.approx(float(fedavg[2]), rel=1e-3, abs=1e-4)  # its own loop
    for row in rows:  # the last column: this method's loop over FedAvg's loop timed in the same turns
        assert float(row[7]) == pytest.approx(float(row[2]) / reference[f"{row[0]} sequential"], rel=0.05, abs=1e-3)
    ratios = {r["method"]: r["value"] for r in records if r["metric"] == "seq_over_fedavg_seq"}
    assert set(ratios) == {f"{m} sequential" for m in methods}


def test_methods_cnn_quick_subset(tmp_path, capsys):
    rows, records, out = run_methods(tmp_path, capsys, "--methods", "FedRep", "FedALA")
    check_rows(rows, records, ["FedAvg", "FedRep", "FedALA"])  # FedAvg first: the last column's reference
    paths = {r[0]: r[1] for r in rows}
    assert paths["FedRep"] == "stacked" and paths["FedALA"] == "sequential"  # not vectorizable: the loop
    assert {r[0]: r[6] for r in rows}["FedALA"] == "same path"
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
