"""``make bench`` (``python -m benchmarks.bench``): every default workload at its smallest size, and a failure late in
a run keeps what the earlier workloads measured in ``results.json``."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench

TINY = ["--device", "cpu", "--quick", "--clients", "3", "--samples", "4", "--rounds", "1"]


@pytest.mark.slow
def test_every_default_workload_of_make_bench_runs_at_its_smallest_size(tmp_path, capsys):
    """What ``make bench`` runs first (its second line, ``benchmarks.scale``, is run by tests/benchmarks/test_scale.py):
    every workload of ``DEFAULT_WORKLOADS``, ``run_axis`` through ``benchmarks.batched_runs`` (one seed of its
    ``digits_fedrep`` workload), each leaving its records."""
    run_axis = "--workloads digits_fedrep --seeds 1"
    assert bench.main([*TINY, "--out", str(tmp_path), "--run_axis_args", run_axis]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"results: {tmp_path / 'results.json'}"
    records = json.loads((tmp_path / "results.json").read_text())
    settings = {r["setting"].split(",")[0] for r in records}
    expected = set(bench.DEFAULT_WORKLOADS) - {"run_axis", "scale"} | {"scale_100", "scale_2000"}
    assert expected <= settings, sorted(settings)
    assert all(r["value"] == r["value"] for r in records if r["metric"] == "train_s_per_round")  # no NaN timing
    batched = json.loads((tmp_path / "run_axis" / "results.json").read_text())
    assert {r["method"] for r in batched if r["metric"] == "wall_s"} == {"sequential x1", "vectorized x1", "batched x1"}
    assert (tmp_path / "round_times.png").stat().st_size > 0


def test_a_failing_workload_keeps_the_records_measured_before_it(tmp_path, monkeypatch, capsys):
    def boom(_: bench.Bench) -> None:
        raise RuntimeError("the machine ran out of something")

    monkeypatch.setitem(bench.WORKLOADS, "boom", boom)
    with pytest.raises(RuntimeError, match="ran out"):
        bench.main([*TINY, "--out", str(tmp_path), "--workloads", "conv_clients", "boom"])
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in records if r["metric"] == "train_s_per_round"} == {"loop", "vmap"}
    assert all(r["setting"].startswith("conv_clients,") for r in records)
    assert "workload boom failed; results.json keeps the" in capsys.readouterr().out


def test_the_run_axis_workload_imports_the_batched_runs_benchmark(tmp_path, monkeypatch):
    """The workload behind ``make bench``'s last table calls ``benchmarks.batched_runs.main`` with its options."""
    from benchmarks import batched_runs

    seen: list[list[str]] = []
    monkeypatch.setattr(batched_runs, "main", lambda argv: seen.append(argv) or 0)
    assert bench.main([*TINY, "--out", str(tmp_path), "--workloads", "run_axis", "--run_axis_args", "--seeds 2"]) == 0
    assert seen == [["--out", str(tmp_path / "run_axis"), "--quick", "--seeds", "2"]]


def test_cuda_asked_without_a_gpu_is_one_line_and_exit_2(capsys, monkeypatch) -> None:
    import torch

    from benchmarks.bench import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        resolve_device("cuda")
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: --device cuda but torch sees no CUDA device"]


def test_the_ratio_band_of_two_rounds_is_their_resampled_medians():
    """Two rounds with ratios a < b: a resample's median is a, (a + b) / 2 or b with probabilities 1/4, 1/2, 1/4, so
    the 90 % band runs from a to b and the 40 % band (30 % cut from each tail) is the midpoint alone."""
    reference, candidate = [3.0, 4.0], [2.0, 2.0]  # ratios 1.5 and 2.0
    wide = bench.ratio_band(reference, candidate, level=0.9)
    assert (wide.median, wide.low, wide.high) == (1.75, 1.5, 2.0)
    narrow = bench.ratio_band(reference, candidate, level=0.4)
    assert (narrow.low, narrow.high) == (1.75, 1.75)


def test_the_ratio_band_pairs_rounds_and_is_reproducible():
    reference = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95, 1.0]
    candidate = [0.5, 0.55, 0.45, 0.6, 0.5, 0.5, 0.5]  # about half the time in every round: ratios near 2
    band = bench.ratio_band(reference, candidate)
    ratios = sorted(a / b for a, b in zip(reference, candidate))
    assert band.median == ratios[3]
    assert ratios[0] <= band.low <= band.median <= band.high <= ratios[-1]
    assert bench.ratio_band(reference, candidate) == band  # seeded
    assert bench.ratio_band([2.0], [4.0]) == bench.RatioBand(0.5, 0.5, 0.5)  # one round: its ratio
    # the ratio is per round, not of the medians: a slow round of the reference paired with a slow candidate round
    assert bench.ratio_band([1.0, 10.0, 1.0], [1.0, 10.0, 1.0]).median == 1.0
    with pytest.raises(ValueError):
        bench.ratio_band([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    ("low", "high", "same_path", "expected"),
    [
        (1.02, 1.3, False, "faster"),
        (0.97, 1.1, False, "tie"),
        (0.8, 0.99, False, "slower"),
        (1.0, 1.0, False, "tie"),  # a band touching 1 is not entirely on one side
        (0.8, 0.9, True, "same path"),  # the loop against itself: its ratio is noise, whatever it reads
        (1.2, 1.3, True, "same path"),
    ],
)
def test_the_verdict_reads_the_band(low, high, same_path, expected):
    band = bench.RatioBand((low + high) / 2, low, high)
    assert bench.verdict(band, same_path) == expected


def test_the_cpu_clock_does_not_count_time_the_thread_waits():
    import argparse
    import time

    import torch

    cpu = bench.Bench(argparse.Namespace(threads=1), torch.device("cpu"))
    start = cpu.clock()
    time.sleep(0.3)
    assert cpu.clock() - start < 0.1
