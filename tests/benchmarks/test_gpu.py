"""``make bench-gpu`` (``python -m benchmarks.gpu``): every part at its smallest size on the CPU, a late failure keeps
what was measured, the FLOP count against a count by hand, and the peak table."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from benchmarks import gpu


@pytest.mark.slow
def test_the_smoke_size_runs_every_part_and_writes_its_records(tmp_path, capsys):
    """``--smoke`` on the CPU with two methods (FedAvg and a two-phase one): the methods' timings and equality, the
    compute part (TFLOP/s, a ``model.compile`` row, bf16), the grid of 2 seeds batched and alone; a table, a PNG,
    ``results.json`` and ``results: PATH`` last."""
    assert gpu.main(["--smoke", "--device", "cpu", "--methods", "Ditto", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"results: {tmp_path / 'results.json'}"
    records = json.loads((tmp_path / "results.json").read_text())
    assert all(set(r) <= {"experiment", "method", "metric", "value", "seed", "setting"} for r in records)
    by = {(r["method"], r["metric"]): r["value"] for r in records}
    for method in ("FedAvg", "Ditto"):
        assert by[(method, "seq_s_per_round")] > 0 and by[(method, "auto_s_per_round")] > 0
        assert by[(method, "auto_equals_seq")] == 1.0, method  # the CPU paths agree to 1e-5
    assert by[("FedAvg auto", "tflops")] > 0 and math.isnan(by[("FedAvg auto", "peak_tflops")])  # a CPU: no peak
    assert by[("FedAvg auto compile=compile", "equals_eager")] == 1.0
    assert ("FedAvg auto bf16-mixed", "max_abs_diff_eager") in by
    assert math.isnan(by[("FedAvg auto", "launches_per_round")])  # launches are counted on CUDA only
    assert by[("FedAvg x2 batched", "batched_equals_alone")] == 1.0
    assert math.isnan(by[("FedAvg x2 batched", "peak_mem_mb")])  # device memory is measured on CUDA only
    assert {r["seed"] for r in records if r["metric"] == "final_acc"} == {0, 1}
    assert all(r["setting"].split(",")[0] in gpu.PARTS for r in records)
    assert (tmp_path / "gpu.png").stat().st_size > 0
    assert "methods on " in out and "compute on " in out and "grid on " in out


def test_a_failing_step_costs_only_its_own_numbers_and_an_interruption_keeps_the_records(tmp_path, monkeypatch,
                                                                                          capsys):  # fmt: skip
    """A step that raises is reported (one line, a ``failed`` record, exit code 1) and the next steps run; an
    interruption stops the command with what was measured before it in ``results.json``."""

    def boom(self: gpu.GpuBench) -> None:
        raise RuntimeError("the compiler gave up\nwith a long traceback")

    monkeypatch.setattr(gpu.GpuBench, "compute", boom)
    engine_log = logging.getLogger("fl_lightning")
    monkeypatch.setattr(engine_log, "level", logging.INFO)  # as train.py leaves it
    argv = ["--smoke", "--device", "cpu", "--methods", "FedAvg", "--parts", "methods", "compute", "--out",
            str(tmp_path)]  # fmt: skip
    assert gpu.main([*argv, "--compile-modes"]) == 1
    out = capsys.readouterr().out
    assert "FAILED compute: RuntimeError: the compiler gave up (results.json keeps the" in out
    assert "failed: compute: RuntimeError: the compiler gave up" in out and out.strip().endswith("results.json")
    records = json.loads((tmp_path / "results.json").read_text())
    assert {"seq_s_per_round", "auto_s_per_round", "auto_equals_seq"} <= {r["metric"] for r in records}
    assert [r["method"] for r in records if r["metric"] == "failed"] == ["compute"]
    assert engine_log.level == logging.INFO  # the command leaves the engine's logger as train.py set it

    def stop(self: gpu.GpuBench) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu.GpuBench, "compute", stop)
    with pytest.raises(KeyboardInterrupt):
        gpu.main([*argv, "--compile-modes"])
    records = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in records} == {"FedAvg"}  # FedAvg's methods row came first and stayed
    assert "part compute interrupted; results.json keeps the" in capsys.readouterr().out


def test_training_flops_per_image_are_the_layers_products_counted_by_hand():
    """FedAvgCNN (conv 3→32 5×5, pool, conv 32→64 5×5, pool, fc 1600→512, head 512→10) on 32×32 inputs: forward
    2·MACs; backward 2·MACs for the weight gradients and 2·MACs for the input gradients of every layer but the first
    (its input needs none)."""
    macs = {"conv1": 28 * 28 * 32 * 5 * 5 * 3, "conv2": 10 * 10 * 64 * 5 * 5 * 32, "fc1": 1600 * 512, "head": 512 * 10}
    total = sum(macs.values())
    expected = 2 * total + 2 * total + 2 * (total - macs["conv1"])
    assert gpu.training_flops_per_image(torch.device("cpu")) == expected


def test_the_launch_counter_counts_the_named_profiler_events_of_one_call():
    """``count_events`` (behind ``launches_per_round``, which counts CUDA launch calls on a GPU) on the CPU: three
    linear layers are three ``aten::addmm`` and one ``aten::relu``; a name that never happens counts 0."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    assert gpu.count_events(lambda: net(x), frozenset({"aten::addmm"}), cuda=False) == 3
    assert gpu.count_events(lambda: net(x), frozenset({"aten::addmm", "aten::relu"}), cuda=False) == 4
    assert gpu.count_events(lambda: net(x), gpu.LAUNCHES, cuda=False) == 0


def test_the_peak_comes_from_the_table_by_card_name_or_the_override(monkeypatch):
    import argparse

    args = argparse.Namespace(peak_tflops=None)
    monkeypatch.setattr(gpu, "device_name", lambda device: "NVIDIA H200")
    assert gpu.peak_tflops(args, torch.device("cpu"), "tf32") == gpu.PEAK_TFLOPS["NVIDIA H200"]["tf32"]
    monkeypatch.setattr(gpu, "device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    assert gpu.peak_tflops(args, torch.device("cpu"), "bf16") == gpu.PEAK_TFLOPS["NVIDIA A100"]["bf16"]
    for other in ("Some Card", "NVIDIA H200 NVL"):  # not listed: no guess
        monkeypatch.setattr(gpu, "device_name", lambda device, name=other: name)
        assert math.isnan(gpu.peak_tflops(args, torch.device("cpu"), "fp32")), other
    assert gpu.peak_tflops(argparse.Namespace(peak_tflops=123.0), torch.device("cpu"), "fp32") == 123.0


def test_the_issue_settings_are_arguments_of_the_methods_and_every_gradient_method_is_timed():
    for name, settings in gpu.ISSUE_SETTINGS.items():
        algorithm = gpu.algorithm_for(name)
        assert all(getattr(algorithm, k) == v for k, v in settings.items()), name
    assert set(gpu.ISSUE_SETTINGS) <= set(gpu.gradient_algorithms())


def test_an_unknown_method_is_one_line(capsys):
    with pytest.raises(SystemExit, match="--methods Nope is not a gradient algorithm"):
        gpu.main(["--smoke", "--device", "cpu", "--methods", "Nope"])
