"""Kill rate per module from mutmut 3's results (``make mutation`` runs this after ``mutmut run``).

mutmut keeps one ``mutants/<path>.py.meta`` JSON file per mutated source file; its ``exit_code_by_key`` maps every
mutant to the exit code of the tests run against it (``None`` while not yet tested). A mutant is *killed* when a
test failed (exit 1/3), timed out or crashed; it *survived* when the tests passed (0) or when no selected test
calls the mutated function ("no tests"). Mutants named in ``tests/mutation_equivalent.md`` (one line each on why
the change cannot alter a result) leave the denominator of ``kill_rate``; ``raw_kill_rate`` keeps them.

    python tools/mutation_report.py [--mutants mutants] [--out results/mutation] [--survivors]

Prints a table (one row per module, then the total), writes ``results.json`` (records ``experiment="mutation"``,
``method=<module>``, metrics ``kill_rate``, ``raw_kill_rate``, ``killed``, ``survived``, ``pending``, …) and prints
``results: PATH`` last.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fl_lightning.results import format_table, record, write_results  # noqa: E402

KILLED_CODES = {1, 3, 24, -24, 152, 255, 36, 37, -9, -11}  # test failure, pytest error, timeout, crash, type check
SURVIVED_CODES = {0}
NO_TESTS_CODES = {5, 33}
SKIPPED_CODES = {34}
MUTANT_NAME = re.compile(r"`([\w.ǁ]+__mutmut_\d+)`")


def classify(exit_code: int | None) -> str:
    if exit_code is None:
        return "pending"
    if exit_code in KILLED_CODES:
        return "killed"
    if exit_code in SURVIVED_CODES:
        return "survived"
    if exit_code in NO_TESTS_CODES:
        return "no_tests"
    if exit_code in SKIPPED_CODES:
        return "skipped"
    return "suspicious"


def equivalent_mutants(path: Path) -> set[str]:
    """Mutant names written in backticks in ``tests/mutation_equivalent.md``."""
    if not path.exists():
        return set()
    return set(MUTANT_NAME.findall(path.read_text(encoding="utf-8")))


def module_of(meta: Path, mutants_dir: Path) -> str:
    """``mutants/fl_lightning/algorithms/fedrep.py.meta`` -> ``fl_lightning/algorithms/fedrep.py``."""
    return meta.relative_to(mutants_dir).as_posix().removesuffix(".meta")


def tally(mutants_dir: Path, equivalent: set[str]) -> dict[str, dict[str, object]]:
    """Per module: counts per status, the surviving mutant names, and how many are listed as equivalent."""
    modules: dict[str, dict[str, object]] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        exit_codes = json.loads(meta.read_text(encoding="utf-8")).get("exit_code_by_key", {})
        if not exit_codes:
            continue
        counts: Counter[str] = Counter()
        survivors: list[str] = []
        for name, code in exit_codes.items():
            status = classify(code)
            if status in ("survived", "no_tests", "suspicious") and name in equivalent:
                status = "equivalent"
            counts[status] += 1
            if status in ("survived", "no_tests", "suspicious"):
                survivors.append(f"{name} ({status})")
        modules[module_of(meta, mutants_dir)] = {"counts": counts, "survivors": sorted(survivors)}
    return modules


def rates(counts: Counter[str]) -> tuple[float, float, int]:
    """(kill_rate without equivalent mutants, raw kill rate, number tested)."""
    tested = counts["killed"] + counts["survived"] + counts["no_tests"] + counts["suspicious"]
    raw_total = tested + counts["equivalent"]
    kill = counts["killed"] / tested if tested else float("nan")
    raw = counts["killed"] / raw_total if raw_total else float("nan")
    return kill, raw, raw_total


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's mutants/ folder")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "mutation", help="where results.json goes")
    parser.add_argument("--equivalent", type=Path, default=ROOT / "tests" / "mutation_equivalent.md")
    parser.add_argument("--survivors", action="store_true", help="list every surviving mutant by name")
    args = parser.parse_args(argv)
    if not args.mutants.is_dir():
        raise SystemExit(f"no mutmut results in {args.mutants}: run `make mutation` first")

    modules = tally(args.mutants, equivalent_mutants(args.equivalent))
    total: Counter[str] = Counter()
    rows, records = [], []
    for module, info in modules.items():
        counts: Counter[str] = info["counts"]  # type: ignore[assignment]
        total.update(counts)
        kill, raw, n = rates(counts)
        rows.append([module, n, counts["killed"], counts["survived"], counts["no_tests"], counts["equivalent"],
                     counts["pending"], kill, raw])
        records += [record("mutation", module, "kill_rate", kill), record("mutation", module, "raw_kill_rate", raw)]
        records += [record("mutation", module, key, counts[key])
                    for key in ("killed", "survived", "no_tests", "equivalent", "pending", "suspicious")]
    kill, raw, n = rates(total)
    rows.append(["TOTAL", n, total["killed"], total["survived"], total["no_tests"], total["equivalent"],
                 total["pending"], kill, raw])
    records += [record("mutation", "TOTAL", "kill_rate", kill), record("mutation", "TOTAL", "raw_kill_rate", raw)]
    records += [record("mutation", "TOTAL", key, total[key])
                for key in ("killed", "survived", "no_tests", "equivalent", "pending", "suspicious")]

    print(format_table(["module", "mutants", "killed", "survived", "no tests", "equivalent", "pending",
                        "kill_rate", "raw_kill_rate"], rows))
    print("kill_rate = killed / (mutants tested - equivalent); pending = not yet tested (run `make mutation` again)")
    if args.survivors:
        for info in modules.values():
            for name in info["survivors"]:  # type: ignore[union-attr]
                print(f"survived  {name}")
    path = write_results(records, args.out)
    print(f"results: {path}")
    return path


if __name__ == "__main__":
    main()
