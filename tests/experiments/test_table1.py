"""``python -m experiments table1`` (``experiments/table1.py``): the transcribed paper table against the spec's
differences, the runner on digits (table, CSV, plot, results.json, one run dir per method and seed) and on a real
column's tiny fixture (the paper's numbers printed next to ours)."""

from __future__ import annotations

import json

from tests.helpers.data_fixtures import make_fixture


def test_paper_table_matches_the_spec_differences():
    """The transcribed Table 1 reproduces spec 000 §4.1's derived differences."""
    from experiments.table1 import PAPER

    def diff(a, b):
        return [round(x - y, 2) for x, y in zip(PAPER[a], PAPER[b])]

    assert diff("fedrep", "fedper") == [0.57, 1.84, 1.54, 3.15, 0.42, 0.29, 1.65]
    assert diff("fedrep", "fedavg_ft") == [0.05, 2.00, 1.23, -0.19, 0.66, 0.49, 6.15]
    assert diff("fedrep", "fedavg") == [45.05, 23.90, 38.96, 55.21, 24.13, 19.66, 26.92]



def test_runner_on_digits_writes_table_and_results(tmp_path, capsys):

    from experiments.table1 import main

    argv = ["--dataset", "digits", "--methods", "fedavg", "fedrep", "--rounds", "2", "--seeds", "2"]
    assert main([*argv, "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"results: {tmp_path / 'results.json'}"
    assert "FedRep" in out and (tmp_path / "table1.csv").exists() and (tmp_path / "table1_digits.png").exists()
    rows = [r for r in json.loads((tmp_path / "results.json").read_text()) if r["metric"] == "acc_last10"]
    assert sorted((r["method"], r["seed"]) for r in rows) == [
        ("fedavg", 0),
        ("fedavg", 1),
        ("fedrep", 0),
        ("fedrep", 1),
    ]
    assert all(0 <= r["value"] <= 1 for r in rows)
    # one run dir per (method, seed), named by the axis labels, under the experiment's name
    dirs = (tmp_path / "runs" / "table1-digits-r2").glob("*/digits/s*")
    found = sorted(f"{p.parent.parent.name}/{p.name}" for p in dirs)
    assert found == ["fedavg/s0", "fedavg/s1", "fedrep/s0", "fedrep/s1"]



def test_runner_on_a_real_column_prints_the_paper_next_to_ours(tmp_path, capsys):
    from experiments.table1 import main

    extra = [*make_fixture("cifar10_100x2", tmp_path), "--model.eval_last=1"]
    argv = ["--dataset", "real", "--columns", "cifar10_100x2", "--methods", "fedavg", "fedrep", "--rounds", "1"]
    argv += ["--seeds", "1", "--runs-dir", str(tmp_path / "runs")]
    assert main([*argv, "--out", str(tmp_path / "out"), "--extra", *extra]) == 0
    out = capsys.readouterr().out
    assert "cifar10_100x2 paper" in out and "87.70" in out and "42.65" in out  # Table 1's FedRep and FedAvg
    assert (tmp_path / "out" / "table1_cifar10_100x2.png").exists()
