"""Reproductions: ``python -m fl_lightning.reproduce NAME [options]``.

Each NAME is a module ``fl_lightning.reproduce.NAME`` with a ``main(argv) -> int``. Every runner prints a
table, writes PNG plots and a ``results.json`` (a flat list of records with ``experiment``, ``method``,
``metric``, ``value`` and optional ``seed``/``setting``), and prints ``results: PATH`` last.
"""
