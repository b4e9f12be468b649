"""``python -m experiments NAME`` (``experiments/__main__.py``): the runners it lists (every module with a ``main``,
helpers left out), the usage, and the dispatch of the remaining arguments to the runner's ``main``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from experiments.__main__ import PREPARERS, available, commands, main

FOLDER = Path(importlib.import_module("experiments").__file__).parent


def test_the_runners_are_the_modules_with_a_main():
    names = available()
    modules = sorted(p.stem for p in FOLDER.glob("*.py") if not p.stem.startswith("_"))
    assert names == [m for m in modules if m not in {"side_information", *PREPARERS}]  # perfedsi's helper: no main
    assert commands() == sorted([*names, "instructions"])  # a data preparer runs, but not in make reproduce
    assert all(callable(importlib.import_module(f"experiments.{n}").main) for n in PREPARERS)
    assert {"table1", "digits", "dp", "leaderboard", "perfedsi"} <= set(names)
    assert all(callable(importlib.import_module(f"experiments.{n}").main) for n in names)


def test_usage_and_dispatch(monkeypatch: pytest.MonkeyPatch, capsys):
    assert main([]) == 2 and main(["nope"]) == 2
    assert main(["--help"]) == 0
    usage = capsys.readouterr().err.splitlines()
    assert usage[0] == f"usage: python -m experiments {{{','.join(commands())}}} [options]" and len(usage) == 3
    seen = []
    monkeypatch.setattr(importlib.import_module("experiments.digits"), "main", lambda argv: seen.append(argv) or 7)
    assert main(["digits", "--seeds", "2"]) == 7 and seen == [["--seeds", "2"]]
