"""Dispatch ``python -m fl_lightning.reproduce NAME ...`` to ``fl_lightning.reproduce.NAME.main``."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import fl_lightning.reproduce as package


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.name not in {"common", "__main__"})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in available():
        print(f"usage: python -m fl_lightning.reproduce {{{','.join(available())}}} [options]", file=sys.stderr)
        return 0 if argv and argv[0] in {"-h", "--help"} else 2
    return importlib.import_module(f"fl_lightning.reproduce.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
