"""``fl_lightning/results.py``: the one plain-text table (``format_table``) with its two cell styles, the run summary
table ``train.py`` prints, and the records and figures the runners share."""

from __future__ import annotations

import json
import math

from fl_lightning.results import (
    format_table,
    record,
    reported_figure,
    summary_cell,
    summary_table,
    table_cell,
    write_results,
)


def test_table_cells_round_to_four_decimals_with_exponents_for_tiny_and_huge_values() -> None:
    assert [table_cell(v) for v in (0.12345, 2.0, 0.001234, 123456.0, 0.0, math.nan, 7, "x")] == [
        "0.1235", "2.0000", "1.234e-03", "1.235e+05", "0.0000", "-", "7", "x",
    ]  # fmt: skip


def test_summary_cells_keep_four_significant_digits_when_tiny_and_one_decimal_from_ten() -> None:
    assert [summary_cell(v) for v in (0.99166, 0.001234, 91.94, 26521600.0, 0.0, 20, "FedRep")] == [
        "0.9917", "0.001234", "91.9", "26521600.0", "0.0000", "20", "FedRep",
    ]  # fmt: skip


def test_format_table_pads_every_column_to_its_widest_cell() -> None:
    table = format_table(["a", "long header"], [["xyz", 1.5], ["q", math.nan]])
    assert table.split("\n") == [
        "a    long header",
        "----------------",
        "xyz  1.5000     ",
        "q    -          ",
    ]
    assert format_table(["only"], []).split("\n") == ["only", "----"]
    assert format_table(["v"], [[0.5]], summary_cell).split("\n")[2] == "0.5000"


def test_the_summary_table_puts_the_fixed_columns_first_then_every_other_key_once() -> None:
    rows = [
        {"algorithm": "FedRep", "final": 0.99166, "rounds": 100, "metric": "acc", "upload_bytes": 26521600.0},
        {"algorithm": "FedAvg", "metric": "acc", "dist_B": 0.0012, "upload_bytes": 1.0},
    ]
    lines = summary_table(rows).split("\n")
    assert lines[0].split() == [
        "algorithm", "metric", "final", "last10", "rounds", "wall_s", "upload_bytes", "dist_B",
    ]  # fmt: skip
    assert lines[2].split() == ["FedRep", "acc", "0.9917", "100", "26521600.0"]  # the missing keys are blank
    assert lines[3].split() == ["FedAvg", "acc", "1.0000", "0.0012"]
    assert len(lines[1]) == len(lines[0]) and set(lines[1]) == {"-"}
    start = lines[0].index("final")
    assert lines[2][start:].startswith("0.9917") and lines[3][start:].startswith(" ")


def test_records_and_the_reported_figure(tmp_path) -> None:
    row = record("exp", "FedAvg", "acc", 0.5, seed=1, setting="s")
    assert row == {"experiment": "exp", "method": "FedAvg", "metric": "acc", "value": 0.5, "seed": 1, "setting": "s"}
    path = write_results([row], tmp_path / "out")
    assert json.loads(path.read_text()) == [row]
    assert reported_figure({"last10": 0.4, "final": 0.5}) == 0.4
    assert reported_figure({"last10": 0.4, "final_ft": 0.7}) == 0.7  # a "+FT" run reports its fine-tuned figure
    assert reported_figure({"final_min": 0.1, "final_ft": 0.7, "final_ft_min": 0.2}, "final_min") == 0.2
