"""Dispatch ``python -m experiments NAME ...`` to ``experiments.NAME.main``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import experiments as package

#: commands that prepare a run's data rather than reproduce a result (``make reproduce`` does not run them)
PREPARERS = ("instructions",)


def available() -> list[str]:
    """The reproduction runners (modules with a ``main``, what ``make reproduce`` runs); helper modules, packages
    and the data preparers (``PREPARERS``) are left out."""
    left_out = {"__main__", "side_information", *PREPARERS}
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg and m.name not in left_out)


def commands() -> list[str]:
    """Everything ``python -m experiments NAME`` runs: the runners and the data preparers."""
    return sorted([*available(), *PREPARERS])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in commands():
        print(f"usage: python -m experiments {{{','.join(commands())}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    return importlib.import_module(f"experiments.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
