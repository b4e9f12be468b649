"""``python -m benchmarks.scale`` at a tiny N, in this process: the printed table, ``results.json``'s records, the
plot, the bank sizes (from the network's layer sizes, by hand) and that the runs' folders are cleaned up."""

from __future__ import annotations

import json
import math

from benchmarks import scale

#: DigitsMLP (64 → 128 → 64 → 10): FedRep keeps the head (64·10 + 10 floats), Ditto the whole model
HEAD = 64 * 10 + 10
MODEL = 64 * 128 + 128 + 128 * 64 + 64 + HEAD


def test_tiny_scale_benchmark_prints_records_and_plots(tmp_path, capsys) -> None:
    assert scale.main(["--sizes", "30", "--rounds", "2", "--inline", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == f"results: {tmp_path / 'results.json'}"
    head = max(i for i, line in enumerate(lines) if line.startswith("method"))
    rows = [line.split() for line in lines[head + 2 : -1] if line.strip()]
    assert [(r[0], r[1], r[2]) for r in rows] == [("fedrep", "30", "device"), ("ditto", "30", "device")]
    records = json.loads((tmp_path / "results.json").read_text())
    metrics = {key for _, key, _ in scale.ROWS}
    for method in scale.METHODS:
        mine = {r["metric"]: r["value"] for r in records if r["method"] == method}
        assert set(mine) == metrics
        assert all(r["experiment"] == "scale" and "N=30" in r["setting"] for r in records)
        assert mine["train_s_per_round"] > 0 and mine["checkpoint_s"] > 0 and mine["peak_rss_bytes"] > 0
        assert math.isfinite(mine["eval_full_s"]) and mine["checkpoint_bytes"] > 0
        assert mine["bank_bytes"] == 30 * 4 * (HEAD if method == "fedrep" else MODEL)
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert not any((tmp_path / "runs").iterdir())
