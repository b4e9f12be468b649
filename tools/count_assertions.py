"""Count the checks in the test suite, by syntax (AST), so that a reorganisation can show it lost none.

A check is an ``assert`` statement, a ``pytest.raises`` / ``pytest.warns`` call (context manager or call form) or a
call of a function whose name starts with ``assert_`` (``assert_close_finite``, ``np.testing.assert_allclose``,
``torch.testing.assert_close``, ...). Definitions are not counted, only the statements and calls themselves.

    python tools/count_assertions.py [PATH ...] [--per-file]

Prints the total over every ``*.py`` under the given paths (default ``tests/``), and with ``--per-file`` one line
per file (``count path``) before it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _call_name(func: ast.expr) -> tuple[str, str]:
    """(owner, name) of a called function: ``pytest.raises`` -> ("pytest", "raises"), ``f`` -> ("", "f")."""
    if isinstance(func, ast.Name):
        return "", func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else ""
        return owner, func.attr
    return "", ""


def count_checks(source: str) -> int:
    """The number of checks (see the module docstring) in one file's source."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            n += 1
        elif isinstance(node, ast.Call):
            owner, name = _call_name(node.func)
            if (owner == "pytest" and name in ("raises", "warns")) or name.startswith("assert_"):
                n += 1
    return n


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[ROOT / "tests"])
    parser.add_argument("--per-file", action="store_true", help="one line per file before the total")
    args = parser.parse_args(argv)
    files = sorted({f for p in args.paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    total = 0
    for f in files:
        n = count_checks(f.read_text())
        total += n
        if args.per_file:
            print(f"{n:6d} {f}")
    print(f"{total} checks in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
