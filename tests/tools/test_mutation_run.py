"""``tools/mutation_run.py``: the capped runner keeps each function's fastest tests within the time budget, one case of
each test function before a second, and deletes stale copies of moved tests."""

from __future__ import annotations

from pathlib import Path

from tools.mutation_run import cap_tests, drop_stale_tests


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
