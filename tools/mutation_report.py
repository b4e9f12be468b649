"""Kill rate per module from mutmut 3's results (``make mutation`` runs this after ``mutmut run``).

mutmut keeps one ``mutants/<path>.py.meta`` JSON file per mutated source file; its ``exit_code_by_key`` maps every
mutant to the exit code of the tests run against it (``None`` while not yet tested). A mutant is *killed* when a
test failed (exit 1/3), timed out or crashed; it *survived* when the tests passed (0) or when no selected test
calls the mutated function ("no tests"). Mutants named in ``tests/mutation_equivalent.md`` (one line each on why
the change cannot alter a result) leave the denominator of ``kill_rate``; ``raw_kill_rate`` keeps them.

mutmut numbers the mutants of a function in order, so a change to the function (or to the mutation settings) can
give an old number to another mutant. Every entry therefore pins the mutated code it was written for:
``- `NAME` (`+mutated line`): why``. An entry whose pinned line is not the mutant's current one is *stale*: it is
not applied (the mutant counts as surviving) and is printed, so it is re-read. ``--pin`` writes the current mutated
line into entries that have none (do it right after reading the diffs you are vouching for).

    python tools/mutation_report.py [--mutants mutants] [--out results/mutation] [--survivors] [--pin]

Prints a table (one row per module, then the total), writes ``results.json`` (records ``experiment="mutation"``,
``method=<module>``, metrics ``kill_rate``, ``raw_kill_rate``, ``killed``, ``survived``, ``pending``, …) and prints
``results: PATH`` last.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fl_lightning.results import format_table, record, write_results  # noqa: E402

KILLED_CODES = {1, 3, 24, -24, 152, 255, 36, 37, -9, -11}  # test failure, pytest error, timeout, crash, type check
SURVIVED_CODES = {0}
NO_TESTS_CODES = {5, 33}
SKIPPED_CODES = {34}
ENTRY = re.compile(r"^- `(?P<name>[\w.ǁ]+__mutmut_\d+)`(?: \(`(?P<pinned>.*)`\))?:", re.MULTILINE)


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


def source_file(name: str, mutants_dir: Path) -> Path:
    """``fl_lightning.engine.aggregation.x_gather_rows__mutmut_3`` -> ``mutants/fl_lightning/engine/aggregation.py``."""
    module = name.rpartition(".")[0]
    return mutants_dir / (module.replace(".", "/") + ".py")


def function_sources(path: Path, cache: dict[Path, dict[str, str]]) -> dict[str, str]:
    """Every function (and method) of a mutated file by name, as dedented source."""
    if path not in cache:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        tree = ast.parse(text) if text else ast.Module(body=[], type_ignores=[])
        lines = text.splitlines()
        cache[path] = {node.name: textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                       for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return cache[path]


def mutated_line(name: str, mutants_dir: Path, cache: dict[Path, dict[str, str]]) -> str | None:
    """The mutant's changed line(s), stripped (several joined by `` ⏎ ``); None when the mutant does not exist."""
    functions = function_sources(source_file(name, mutants_dir), cache)
    mutant = name.rpartition(".")[2]
    original = mutant.partition("__mutmut_")[0] + "__mutmut_orig"
    if mutant not in functions or original not in functions:
        return None
    body = [line.replace(mutant, "F") for line in functions[mutant].splitlines()]
    orig = [line.replace(original, "F") for line in functions[original].splitlines()]
    diff = difflib.unified_diff(orig, body, lineterm="", n=0)
    added = [line[1:].strip() for line in diff if line.startswith("+") and not line.startswith("+++")]
    return " ⏎ ".join(added)


def equivalent_mutants(path: Path, mutants_dir: Path) -> tuple[set[str], list[str]]:
    """The names listed in ``tests/mutation_equivalent.md`` whose pinned line is still theirs, and the stale ones."""
    if not path.exists():
        return set(), []
    cache: dict[Path, dict[str, str]] = {}
    valid, stale = set(), []
    for match in ENTRY.finditer(path.read_text(encoding="utf-8")):
        name, pinned = match["name"], match["pinned"]
        current = mutated_line(name, mutants_dir, cache)
        if current is not None and (pinned is None or pinned == current):
            valid.add(name)
        elif current is not None or pinned is not None:
            stale.append(f"{name} (pinned `{pinned}`, now `{current}`)")
    return valid, stale


def pin_entries(path: Path, mutants_dir: Path) -> int:
    """Write the current mutated line into every entry that has none; returns how many were pinned."""
    cache: dict[Path, dict[str, str]] = {}
    pinned = 0

    def pin(match: re.Match[str]) -> str:
        nonlocal pinned
        current = mutated_line(match["name"], mutants_dir, cache)
        if match["pinned"] is not None or current is None:
            return match[0]
        pinned += 1
        return f"- `{match['name']}` (`{current}`):"

    path.write_text(ENTRY.sub(pin, path.read_text(encoding="utf-8")), encoding="utf-8")
    return pinned


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
    parser.add_argument("--pin", action="store_true", help="pin unpinned equivalence entries to their mutated line")
    args = parser.parse_args(argv)
    if not args.mutants.is_dir():
        raise SystemExit(f"no mutmut results in {args.mutants}: run `make mutation` first")
    if args.pin:
        print(f"pinned {pin_entries(args.equivalent, args.mutants)} entries of {args.equivalent}")

    equivalent, stale = equivalent_mutants(args.equivalent, args.mutants)
    modules = tally(args.mutants, equivalent)
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
    for entry in stale:
        print(f"stale equivalence entry (not applied; re-read the mutant): {entry}")
    if args.survivors:
        for info in modules.values():
            for name in info["survivors"]:  # type: ignore[union-attr]
                print(f"survived  {name}")
    path = write_results(records, args.out)
    print(f"results: {path}")
    return path


if __name__ == "__main__":
    main()
