"""``fl_lightning/experiment/run_axis/__main__.py``: one run per seed with its own run dir, the usage, and the
one-line refusals of the command line before any run starts (the runs themselves: ``test_driver.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_lightning.experiment.run_axis import __main__ as run_axis
from fl_lightning.experiment.run_axis.__main__ import main, seed_runs


def test_each_seed_is_a_run_in_its_own_run_dir() -> None:
    args = ["--config", "a.yaml", "--run_dir", "out/job", "--model.lr", "0.1"]
    assert seed_runs(args, [3, 0]) == [
        ["--config", "a.yaml", "--model.lr", "0.1", "--seed_everything", "3", "--run_dir", str(Path("out/job/s3"))],
        ["--config", "a.yaml", "--model.lr", "0.1", "--seed_everything", "0", "--run_dir", str(Path("out/job/s0"))],
    ]
    assert seed_runs(["--run_dir=x", "--k", "v"], [1]) == [["--k", "v", "--seed_everything", "1", "--run_dir",
                                                             str(Path("x/s1"))]]  # fmt: skip
    default = seed_runs(["--config", "c/base.yaml", "--config", "c/fedrep.yaml"], [2])[0]
    assert default[-1] == str(Path("runs/base_fedrep/s2"))  # runs/<config stems>


def test_usage_and_refusals_are_one_line_with_exit_code_2(tmp_path: Path, capsys, monkeypatch) -> None:
    started: list = []
    monkeypatch.setattr("fl_lightning.experiment.run_axis.driver.BatchedRuns.run", lambda self: started.append(1))
    assert main(["--help"]) == 0 and capsys.readouterr().out.startswith("usage: python -m fl_lightning.experiment")
    assert main([]) == 2 and capsys.readouterr().err.startswith("usage:")
    cases = {
        ("--config", "a.yaml"): "error: give --seeds S1,S2,... or --runs FILE.json",
        ("--seeds", "1,x"): "error: --seeds '1,x': expected comma-separated integers",
        ("--seeds", ","): "error: --seeds: expected comma-separated integers",
    }
    for argv, line in cases.items():
        assert main(list(argv)) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    bad = tmp_path / "runs.json"
    bad.write_text(json.dumps({"args": []}))
    assert main(["--runs", str(bad)]) == 2
    assert "expected a JSON list of argument lists" in capsys.readouterr().err
    assert started == []  # nothing ran


def test_a_runs_file_of_objects_names_each_run_and_its_log(tmp_path: Path, monkeypatch) -> None:
    seen = {}

    class Recorder:
        def __init__(self, runs, names, logs=None) -> None:
            seen.update(runs=runs, names=names, logs=logs)

        def run(self) -> list:
            return []

    monkeypatch.setattr("fl_lightning.experiment.run_axis.driver.BatchedRuns", Recorder)
    file = tmp_path / "runs.json"
    file.write_text(json.dumps([{"args": ["--a", "1"], "name": "first", "log": "a.log"},
                                {"args": ["--a", "2"], "name": "second", "log": "b.log"}]))  # fmt: skip
    assert run_axis.main(["--runs", str(file)]) == 0
    assert seen == {"runs": [["--a", "1"], ["--a", "2"]], "names": ["first", "second"], "logs": ["a.log", "b.log"]}
    file.write_text(json.dumps([["--a", "1"]]))
    assert run_axis.main(["--runs", str(file)]) == 0
    assert seen == {"runs": [["--a", "1"]], "names": None, "logs": None}


@pytest.mark.parametrize("seeds", ["0,0", "2,1,2"])
def test_a_seed_given_twice_is_refused(seeds: str, capsys) -> None:
    assert main(["--config", "a.yaml", "--seeds", seeds]) == 2
    assert "is given twice" in capsys.readouterr().err
