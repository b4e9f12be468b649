"""``mutmut run`` with every function's tests capped at N, fastest first (what ``make mutation`` calls).

mutmut runs, for each mutant, every (unmarked) test that called the mutated function, fastest first, stopping at the
first failure. A killed mutant is cheap; a surviving one re-runs all of them. The round and module code is called by
almost every test (about 250 tests, some 190 s on one core), so each survivor there would cost minutes and a first
run many hours on 2 cores. With ``--max-tests N`` each function keeps only N of the tests that call it, the
fastest case of each test function first (the unit tests written for it are usually among them); a mutant that only
a slower test would kill then counts as surviving, so the reported kill rate is a lower bound. ``--max-tests 0``
runs mutmut unchanged, with every test; use it on named survivors to see whether a slower test already kills them.
The cap lives only in this process: mutmut's saved statistics (``mutants/mutmut-stats.json``) keep every test.

    python tools/mutation_run.py [--max-tests N] [--max-children K] [MUTANT_NAME_OR_GLOB ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cap_tests(tests_by_function: dict[str, set[str]], duration_by_test: dict[str, float], limit: int) -> int:
    """Keep at most ``limit`` tests per function, spread over test functions: the fastest case of every test function
    first (fastest function first), then every function's second-fastest case, and so on, so that one parametrized
    test cannot fill the selection with its cases. Returns how many selections were cut."""
    cut = 0
    for function, tests in tests_by_function.items():
        if len(tests) <= limit:
            continue
        cases: dict[str, list[str]] = {}
        for test in sorted(tests, key=lambda t: (duration_by_test.get(t, 0.0), t)):
            cases.setdefault(test.partition("[")[0], []).append(test)
        rounds = [test for depth in range(max(map(len, cases.values()))) for group in cases.values()
                  for test in group[depth : depth + 1]]
        tests_by_function[function] = set(rounds[:limit])
        cut += 1
    return cut


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tests", type=int, default=20, help="tests per mutated function (0: all)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once")
    parser.add_argument("mutants", nargs="*", help="mutant names or globs (default: every mutant not yet tested)")
    args = parser.parse_args(argv)

    import mutmut.__main__ as mutmut_main
    from mutmut.state import state

    if args.max_tests > 0:
        load_stats = mutmut_main.collect_or_load_stats

        def collect_then_cap(*a: Any, **kw: Any) -> None:
            load_stats(*a, **kw)  # collects/loads and saves the full statistics first
            cut = cap_tests(state().tests_by_mangled_function_name, state().duration_by_test, args.max_tests)
            print(f"    test selection capped at the {args.max_tests} fastest tests for {cut} functions")

        mutmut_main.collect_or_load_stats = collect_then_cap
    mutmut_main.run.main(["--max-children", str(args.max_children), *args.mutants], standalone_mode=False)


if __name__ == "__main__":
    main(sys.argv[1:])
