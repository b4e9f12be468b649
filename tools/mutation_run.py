"""``mutmut run`` with every function's tests capped at N, fastest first (what ``make mutation`` calls).

mutmut runs, for each mutant, every (unmarked) test that called the mutated function, fastest first, stopping at the
first failure. A killed mutant is cheap; a surviving one re-runs all of them. The round and module code is called by
almost every test (about 250 tests, some 190 s on one core), so each survivor there would cost minutes and a first
run many hours on 2 cores. With ``--max-tests N`` each function keeps only N of the tests that call it, the
fastest case of each test function first (the unit tests written for it are usually among them); a mutant that only
a slower test would kill then counts as surviving, so the reported kill rate is a lower bound. ``--max-tests 0``
runs mutmut unchanged, with every test; use it on named survivors to see whether a slower test already kills them.
``--max-seconds S`` also caps the recorded duration of each function's kept tests at S seconds (the first test is
always kept): without it a surviving mutant of the round code still costs its 20 tests, half a minute or more.
The cap lives only in this process: mutmut's saved statistics (``mutants/mutmut-stats.json``) keep every test.
mutmut copies ``tests/`` over ``mutants/tests`` without deleting, so a test file moved or removed since the last run
would stay there (and fail to import); such stale copies are deleted first (mutmut drops their test names from its
statistics by itself).

    python tools/mutation_run.py [--max-tests N] [--max-seconds S] [--max-children K] [MUTANT_NAME_OR_GLOB ...]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cap_tests(
    tests_by_function: dict[str, set[str]], duration_by_test: dict[str, float], limit: int, max_seconds: float = 0.0
) -> int:
    """Keep at most ``limit`` tests per function (0: no limit), spread over test functions: the fastest case of every
    test function first (fastest function first), then every function's second-fastest case, and so on, so that one
    parametrized test cannot fill the selection with its cases. With ``max_seconds`` > 0 the kept tests' recorded
    durations also sum to at most that (a test that does not fit is skipped, a later, faster one may still fit; the
    first test is always kept), which bounds what one surviving mutant costs. Returns how many selections were cut."""
    cut = 0
    for function, tests in tests_by_function.items():
        if not tests:
            continue
        cases: dict[str, list[str]] = {}
        for test in sorted(tests, key=lambda t: (duration_by_test.get(t, 0.0), t)):
            cases.setdefault(test.partition("[")[0], []).append(test)
        rounds = [test for depth in range(max(map(len, cases.values()))) for group in cases.values()
                  for test in group[depth : depth + 1]]
        kept: list[str] = []
        seconds = 0.0
        for test in rounds:
            if limit > 0 and len(kept) == limit:
                break
            duration = duration_by_test.get(test, 0.0)
            if max_seconds > 0 and kept and seconds + duration > max_seconds:
                continue
            kept.append(test)
            seconds += duration
        if len(kept) < len(tests):
            tests_by_function[function] = set(kept)
            cut += 1
    return cut


def drop_stale_tests(tests: Path, copy: Path) -> list[Path]:
    """Delete the files and folders under ``copy`` (a copy of ``tests``) that ``tests`` no longer has; returns them,
    relative to ``copy``. ``__pycache__`` folders go with the sources they cached."""
    if not copy.is_dir():
        return []
    stale = []
    for path in sorted(copy.rglob("*"), key=lambda p: len(p.parts)):
        rel = path.relative_to(copy)
        if any(s in stale for s in rel.parents):
            continue
        if "__pycache__" in rel.parts or not (tests / rel).exists():
            stale.append(rel)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return stale


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tests", type=int, default=20, help="tests per mutated function (0: all)")
    parser.add_argument(
        "--max-seconds", type=float, default=0.0, help="recorded test seconds per mutated function (0: no limit)"
    )
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("mutants", nargs="*", help="mutant names or globs (default: every mutant not yet tested)")
    args = parser.parse_args(argv)

    stale = drop_stale_tests(ROOT / "tests", ROOT / "mutants" / "tests")
    if stale:
        print(f"    removed {len(stale)} stale copies from mutants/tests (moved or deleted since the last run)")
    import mutmut.__main__ as mutmut_main
    from mutmut.state import state

    if args.max_tests > 0 or args.max_seconds > 0:
        load_stats = mutmut_main.collect_or_load_stats

        def collect_then_cap(*a: Any, **kw: Any) -> None:
            load_stats(*a, **kw)  # collects/loads and saves the full statistics first
            selection, durations = state().tests_by_mangled_function_name, state().duration_by_test
            cut = cap_tests(selection, durations, args.max_tests, args.max_seconds)
            print(f"    test selection capped ({args.max_tests} tests, {args.max_seconds:g} s) for {cut} functions")

        mutmut_main.collect_or_load_stats = collect_then_cap
    mutmut_main.run.main(["--max-children", str(args.max_children), *args.mutants], standalone_mode=False)


if __name__ == "__main__":
    main(sys.argv[1:])
