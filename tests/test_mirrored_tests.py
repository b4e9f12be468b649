"""Tests mirror the source (issue 41): a module's tests are found by its name.

``fl_lightning/x/y.py`` -> ``tests/x/test_y.py``; ``datamodules/y.py`` -> ``tests/datamodules/test_y.py`` (the same for
``SOURCES``' other folders). A module whose tests are many may hold them in a folder of its own name instead,
``tests/x/y/`` with at least one ``test_*.py`` (``fl_lightning/cli.py`` -> ``tests/cli/``); a package's
``__main__.py`` (the command line of ``python -m x``) is mirrored by ``tests/x/test_main.py``.

An ``__init__.py`` that defines no function or class and runs no statement of its own (a docstring, imports, names and
``__all__``) has nothing to test of its own and needs no mirror; this test checks that it stays so. Every other
module without its mirrored file must be in ``EXEMPT`` with the reason (none is, today); an entry whose module gained
its file, left the repository or has no reason fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the source folders whose modules are mirrored, and where their tests live: ``fl_lightning``'s folders are mirrored
#: at the top of ``tests/`` (``tests/engine/``…), every other folder under its own name (``tests/datamodules/``…)
SOURCES = {
    "fl_lightning": "tests",
    "datamodules": "tests/datamodules",
    "experiments": "tests/experiments",
    "benchmarks": "tests/benchmarks",
    "tools": "tests/tools",
}
#: modules without their mirrored test file, each with why (keep it short: a module that can be tested gets a file)
EXEMPT: dict[str, str] = {}

#: top-level statements an ``__init__.py`` of re-exports may hold
PLAIN = (ast.Expr, ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.AugAssign)


def source_modules() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def mirrors(module: Path) -> list[Path]:
    """Where ``module``'s tests may be: its mirrored file, or (for a module) a folder of its own name."""
    relative = module.relative_to(ROOT)
    top, rest = relative.parts[0], relative.parts[1:]
    folder = ROOT / SOURCES[top] / Path(*rest).parent
    name = "main" if module.stem == "__main__" else module.stem
    return [folder / f"test_{name}.py", folder / name]


def has_tests(module: Path) -> bool:
    file, folder = mirrors(module)
    return file.is_file() or (folder.is_dir() and any(folder.glob("test_*.py")))


def only_reexports(module: Path) -> bool:
    """An ``__init__.py`` of a docstring, imports, names and ``__all__``: no function, class or statement to test."""
    if module.name != "__init__.py":
        return False
    return all(isinstance(node, PLAIN) for node in ast.parse(module.read_text()).body)


def problems(exempt: dict[str, str]) -> list[str]:
    """Every module without its mirror and not exempt, and every exemption that no longer holds (its module gained
    its tests, left the repository, or is an ``__init__.py`` of re-exports, which needs none)."""
    found = []
    for module in source_modules():
        name = str(module.relative_to(ROOT))
        if not has_tests(module) and not only_reexports(module) and name not in exempt:
            found.append(f"{name}: no {mirrors(module)[0].relative_to(ROOT)}")
    for name, reason in exempt.items():
        module = ROOT / name
        if not module.is_file():
            found.append(f"{name} is exempt but no longer exists")
        elif has_tests(module) or only_reexports(module):
            found.append(f"{name} is exempt but needs no exemption now")
        elif not reason.strip():
            found.append(f"{name} is exempt without a reason")
    return found


def test_every_module_has_its_mirrored_test_file_or_an_exemption() -> None:
    assert problems(EXEMPT) == []
    assert len(EXEMPT) <= 10, "the exemptions are a short list; a module that can be tested gets its file"


def test_no_two_modules_share_a_mirror() -> None:
    """The mapping is one to one: ``datamodules/digits.py``, ``fl_lightning/models/digits.py`` and
    ``experiments/digits.py`` are mirrored by three different files."""
    seen: dict[Path, Path] = {}
    for module in source_modules():
        file = mirrors(module)[0]
        assert file not in seen, f"{module} and {seen[file]} would share {file}"
        seen[file] = module


def test_the_rules_on_a_tree_written_here(tmp_path: Path, monkeypatch) -> None:
    """On a small tree: a mirrored file, a test folder of the module's name, a ``__main__``, an ``__init__`` of
    re-exports pass; a module without tests and an ``__init__`` that defines a function do not."""
    for path, text in {
        "fl_lightning/__init__.py": '"""The package."""\nfrom fl_lightning.a import f\n__all__ = ["f"]\n',
        "fl_lightning/a.py": "def f():\n    return 1\n",
        "fl_lightning/b.py": "def g():\n    return 2\n",
        "fl_lightning/c.py": "def h():\n    return 3\n",
        "fl_lightning/d/__init__.py": "def helper():\n    return 4\n",
        "fl_lightning/d/__main__.py": "print(1)\n",
        "tests/test_a.py": "",
        "tests/c/test_parts.py": "",
        "tests/d/test_main.py": "",
    }.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", tmp_path)
    monkeypatch.setattr(here, "SOURCES", {"fl_lightning": "tests"})
    verdict = {str(m.relative_to(tmp_path)): has_tests(m) or only_reexports(m) for m in source_modules()}
    assert verdict == {
        "fl_lightning/__init__.py": True,
        "fl_lightning/a.py": True,
        "fl_lightning/b.py": False,
        "fl_lightning/c.py": True,
        "fl_lightning/d/__init__.py": False,
        "fl_lightning/d/__main__.py": True,
    }
    assert problems({}) == ["fl_lightning/b.py: no tests/test_b.py",
                            "fl_lightning/d/__init__.py: no tests/d/test___init__.py"]  # fmt: skip
    assert problems({"fl_lightning/b.py": "why", "fl_lightning/d/__init__.py": "why"}) == []
    assert problems({"fl_lightning/b.py": "why", "fl_lightning/d/__init__.py": " ", "fl_lightning/a.py": "why",
                     "fl_lightning/gone.py": "why"}) == [
        "fl_lightning/d/__init__.py is exempt without a reason",
        "fl_lightning/a.py is exempt but needs no exemption now",
        "fl_lightning/gone.py is exempt but no longer exists",
    ]  # fmt: skip
