"""Every test file a docstring, comment or page names (``tests/…/test_y.py``, optionally ``::test_name``) exists, and
so does the named test: a test file that moves must take the sentences that point at it along."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: where the project's prose names test files: the packages, the runners, the tools and the pages
SOURCES = ("fl_lightning", "datamodules", "experiments", "benchmarks", "tools", "docs", "train.py", "README.md")
NAMED = re.compile(r"tests/[A-Za-z0-9_/]+\.py(?:::[A-Za-z0-9_]+)?")
#: names that stand for any test file in usage lines (``mutant_tests.py NAME -- tests/test_x.py``)
PLACEHOLDERS = {"test_x.py"}


def named_test_files(root: Path = ROOT) -> list[tuple[str, str]]:
    """(where, what) for every ``tests/...py[::name]`` the sources name."""
    files: list[Path] = []
    for source in SOURCES:
        path = root / source
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md"))
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in NAMED.findall(line):
                if match.split("::")[0].rpartition("/")[2] not in PLACEHOLDERS:
                    found.append((f"{path.relative_to(root)}:{number}", match))
    return found


def missing(named: list[tuple[str, str]], root: Path = ROOT) -> list[str]:
    """The named files (or tests) that do not exist."""
    out = []
    for where, what in named:
        file, _, test = what.partition("::")
        path = root / file
        if not path.is_file():
            out.append(f"{where}: {file} does not exist")
        elif test and not re.search(rf"^\s*(async\s+)?def {test}\b", path.read_text(), flags=re.M):
            out.append(f"{where}: {file} has no {test}")
    return out


def test_the_scan_finds_the_named_files() -> None:
    named = named_test_files()
    assert len(named) >= 20
    assert any(what == "tests/properties/test_privacy.py" and where.startswith("fl_lightning/algorithms/base.py")
               for where, what in named)  # fmt: skip


def test_a_moved_file_and_a_renamed_test_are_reported(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_here.py").write_text("def test_a():\n    pass\n")
    named = [
        ("x.py:1", "tests/test_here.py"),
        ("x.py:2", "tests/test_gone.py"),
        ("x.py:3", "tests/test_here.py::test_a"),
        ("x.py:4", "tests/test_here.py::test_b"),
    ]
    assert missing(named, tmp_path) == [
        "x.py:2: tests/test_gone.py does not exist",
        "x.py:4: tests/test_here.py has no test_b",
    ]


def test_every_named_test_file_exists() -> None:
    assert missing(named_test_files()) == []
