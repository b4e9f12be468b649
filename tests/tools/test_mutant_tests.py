"""``tools/mutant_tests.py``: the chosen tests run once without a mutant (they must pass) and once per named mutant,
each reported ``killed`` or ``SURVIVED`` with the exit status that says whether all were killed; the tests are copied
into ``mutants/`` first. pytest itself is replaced here by a stand-in that fails under the mutants chosen to die."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import mutant_tests  # noqa: E402


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "engine" / "test_x.py").write_text("def test_x(): pass\n")
    (tmp_path / "mutants").mkdir()
    monkeypatch.setattr(mutant_tests, "ROOT", tmp_path)
    monkeypatch.setattr(mutant_tests, "MUTANTS", tmp_path / "mutants")
    runs: list[tuple[str, list[str]]] = []
    dies = {"", "m.killed_1", "m.killed_2"}  # "" fails only when the test below asks the tests to fail unmutated

    def run_tests(mutant: str, args: list[str]) -> int:
        runs.append((mutant, args))
        return 1 if mutant in dies and (mutant or "broken" in args) else 0

    monkeypatch.setattr(mutant_tests, "run_tests", run_tests)
    return runs


def test_each_mutant_is_reported_and_the_status_says_whether_all_died(repo, tmp_path: Path, capsys) -> None:
    args = ["tests/engine/test_x.py", "-k", "x"]
    assert mutant_tests.main(["m.killed_1", "m.killed_2", "--", *args]) == 0
    assert capsys.readouterr().out.splitlines() == ["killed   m.killed_1", "killed   m.killed_2"]
    assert repo == [("", args), ("m.killed_1", args), ("m.killed_2", args)]  # unmutated first
    assert (tmp_path / "mutants" / "tests" / "engine" / "test_x.py").is_file()  # the current tests were copied
    assert mutant_tests.main(["m.killed_1", "m.lives", "--", *args]) == 1
    assert capsys.readouterr().out.splitlines() == ["killed   m.killed_1", "SURVIVED m.lives"]


def test_tests_failing_unmutated_or_a_bad_command_line_stop_with_status_2(repo, tmp_path: Path, capsys) -> None:
    assert mutant_tests.main(["m.killed_1", "--", "broken"]) == 2
    assert "the tests fail on the unmutated code" in capsys.readouterr().err
    assert [m for m, _ in repo] == [""]  # no mutant ran
    for argv in (["m.a"], ["--", "tests"], ["m.a", "--"]):
        assert mutant_tests.main(argv) == 2
        assert capsys.readouterr().err.strip().startswith("python tools/mutant_tests.py NAME")
    shutil.rmtree(tmp_path / "mutants")
    assert mutant_tests.main(["m.a", "--", "tests"]) == 2
    assert "no mutants/ folder" in capsys.readouterr().err
