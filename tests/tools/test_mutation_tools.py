"""The mutation-testing tools: the report applies an equivalence entry only while its pinned mutated line is still
the mutant's (mutmut renumbers a function's mutants when the function changes), ``--pin`` fills in missing lines,
kill rates leave listed mutants out; the capped runner keeps each function's N fastest tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import mutation_report
from tools.mutation_run import cap_tests, drop_stale_tests

MUTATED_FILE = '''
def x_scale__mutmut_orig(v):
    return v * 2


def x_scale__mutmut_1(v):
    return v / 2


def x_scale__mutmut_2(v):
    return v * 3


class Box:
    def xǁBoxǁsize__mutmut_orig(self):
        return len(self.items)

    def xǁBoxǁsize__mutmut_1(self):
        return None
'''


@pytest.fixture
def mutants(tmp_path: Path) -> Path:
    root = tmp_path / "mutants"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(MUTATED_FILE, encoding="utf-8")
    codes = {"pkg.mod.x_scale__mutmut_1": 0, "pkg.mod.x_scale__mutmut_2": 1, "pkg.mod.xǁBoxǁsize__mutmut_1": 0}
    (root / "pkg" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": codes}), encoding="utf-8")
    return root


def test_mutated_line_of_functions_and_methods(mutants: Path) -> None:
    cache: dict = {}
    assert mutation_report.mutated_line("pkg.mod.x_scale__mutmut_1", mutants, cache) == "return v / 2"
    assert mutation_report.mutated_line("pkg.mod.xǁBoxǁsize__mutmut_1", mutants, cache) == "return None"
    assert mutation_report.mutated_line("pkg.mod.x_scale__mutmut_9", mutants, cache) is None


def test_only_entries_whose_pinned_line_still_matches_are_applied(mutants: Path, tmp_path: Path) -> None:
    listed = tmp_path / "equivalent.md"
    listed.write_text(
        "- `pkg.mod.x_scale__mutmut_1` (`return v * 3`): written for another mutant before a renumbering.\n"
        "- `pkg.mod.xǁBoxǁsize__mutmut_1` (`return None`): still the same mutant.\n",
        encoding="utf-8",
    )
    valid, stale = mutation_report.equivalent_mutants(listed, mutants)
    assert valid == {"pkg.mod.xǁBoxǁsize__mutmut_1"}
    assert len(stale) == 1 and stale[0].startswith("pkg.mod.x_scale__mutmut_1")
    counts = mutation_report.tally(mutants, valid)["pkg/mod.py"]["counts"]
    assert (counts["killed"], counts["survived"], counts["equivalent"]) == (1, 1, 1)
    kill, raw, total = mutation_report.rates(counts)
    assert (kill, raw, total) == (1 / 2, 1 / 3, 3)


def test_pin_writes_the_current_line_into_unpinned_entries_only(mutants: Path, tmp_path: Path) -> None:
    listed = tmp_path / "equivalent.md"
    listed.write_text(
        "- `pkg.mod.x_scale__mutmut_1`: why.\n- `pkg.mod.xǁBoxǁsize__mutmut_1` (`return None`): why.\n",
        encoding="utf-8",
    )
    assert mutation_report.pin_entries(listed, mutants) == 1
    assert listed.read_text(encoding="utf-8").splitlines()[0] == "- `pkg.mod.x_scale__mutmut_1` (`return v / 2`): why."
    assert mutation_report.pin_entries(listed, mutants) == 0


def test_cap_keeps_the_fastest_tests_of_each_function() -> None:
    durations = {"a": 3.0, "b": 0.1, "c": 0.5, "d": 0.1, "e": 9.0}
    selection = {"f": {"a", "b", "c", "d", "e"}, "g": {"e", "a"}}
    assert cap_tests(selection, durations, 3) == 1
    assert selection == {"f": {"b", "d", "c"}, "g": {"e", "a"}}


def test_time_budget_skips_tests_that_do_not_fit_and_always_keeps_the_first() -> None:
    """Order: a (1 s), b (2 s), c (3 s), d (4 s). A 6 s budget keeps a + b (3 s), skips c (would be 6 s... fits
    exactly: 1 + 2 + 3 = 6) and then d (10 s): {a, b, c}; a 2.5 s budget keeps a, skips b (3 s) and everything after;
    a budget below the fastest test still keeps that one test; 0 means no budget."""
    durations = {"t::a": 1.0, "t::b": 2.0, "t::c": 3.0, "t::d": 4.0}
    for budget, expected in [(6.0, {"t::a", "t::b", "t::c"}), (2.5, {"t::a"}), (0.5, {"t::a"}), (0.0, set(durations))]:
        selection = {"f": set(durations)}
        cut = cap_tests(selection, durations, 0, budget)
        assert selection["f"] == expected, budget
        assert cut == (expected != set(durations))
    # a slow test that does not fit is skipped, a later faster one still fits (round-robin order: p[1], q, p[2])
    durations = {"t::p[1]": 1.0, "t::p[2]": 1.5, "t::q": 5.0}
    selection = {"f": set(durations)}
    cap_tests(selection, durations, 20, 3.0)
    assert selection["f"] == {"t::p[1]", "t::p[2]"}


def test_cap_takes_one_case_of_each_test_function_before_a_second() -> None:
    durations = {"t::p[1]": 0.0, "t::p[2]": 0.0, "t::p[3]": 0.0, "t::q": 0.2, "t::r[1]": 0.1, "t::r[2]": 0.3}
    selection = {"f": set(durations)}
    cap_tests(selection, durations, 4)
    assert selection["f"] == {"t::p[1]", "t::r[1]", "t::q", "t::p[2]"}


def test_stale_copies_of_moved_tests_are_deleted_and_current_ones_kept(tmp_path: Path) -> None:
    """mutmut copies tests/ over mutants/tests without deleting: a file moved since (and its cache) must go."""
    tests, copy = tmp_path / "tests", tmp_path / "mutants" / "tests"
    for root in (tests, copy):
        (root / "engine").mkdir(parents=True)
        (root / "engine" / "test_module.py").write_text("x = 1\n")
    (copy / "test_mut_module_config.py").write_text("import helpers\n")
    (copy / "old").mkdir()
    (copy / "old" / "test_a.py").write_text("")
    (copy / "engine" / "__pycache__").mkdir()
    (copy / "engine" / "__pycache__" / "test_module.cpython-311.pyc").write_bytes(b"")
    stale = drop_stale_tests(tests, copy)
    assert sorted(map(str, stale)) == ["engine/__pycache__", "old", "test_mut_module_config.py"]
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == ["engine", "engine/test_module.py"]
    assert drop_stale_tests(tests, tmp_path / "absent") == []
