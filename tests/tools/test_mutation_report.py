"""``tools/mutation_report.py``: the report applies an equivalence entry only while its pinned mutated line is still
the mutant's (mutmut renumbers a function's mutants when the function changes), ``--pin`` fills in missing lines,
kill rates leave listed mutants out (the capped runner: ``test_mutation_run.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import mutation_report

MUTATED_FILE = '''
def x_scale__mutmut_orig(v):
    return v * 2


def x_scale__mutmut_1(v):
    return v / 2


def x_scale__mutmut_2(v):
    return v * 3


class Box:
    def xǁBoxǁsize__mutmut_orig(self):
        return len(self.items)

    def xǁBoxǁsize__mutmut_1(self):
        return None
'''


@pytest.fixture
def mutants(tmp_path: Path) -> Path:
    root = tmp_path / "mutants"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(MUTATED_FILE, encoding="utf-8")
    codes = {"pkg.mod.x_scale__mutmut_1": 0, "pkg.mod.x_scale__mutmut_2": 1, "pkg.mod.xǁBoxǁsize__mutmut_1": 0}
    (root / "pkg" / "mod.py.meta").write_text(json.dumps({"exit_code_by_key": codes}), encoding="utf-8")
    return root


def test_mutated_line_of_functions_and_methods(mutants: Path) -> None:
    cache: dict = {}
    assert mutation_report.mutated_line("pkg.mod.x_scale__mutmut_1", mutants, cache) == "return v / 2"
    assert mutation_report.mutated_line("pkg.mod.xǁBoxǁsize__mutmut_1", mutants, cache) == "return None"
    assert mutation_report.mutated_line("pkg.mod.x_scale__mutmut_9", mutants, cache) is None


def test_only_entries_whose_pinned_line_still_matches_are_applied(mutants: Path, tmp_path: Path) -> None:
    listed = tmp_path / "equivalent.md"
    listed.write_text(
        "- `pkg.mod.x_scale__mutmut_1` (`return v * 3`): written for another mutant before a renumbering.\n"
        "- `pkg.mod.xǁBoxǁsize__mutmut_1` (`return None`): still the same mutant.\n",
        encoding="utf-8",
    )
    valid, stale = mutation_report.equivalent_mutants(listed, mutants)
    assert valid == {"pkg.mod.xǁBoxǁsize__mutmut_1"}
    assert len(stale) == 1 and stale[0].startswith("pkg.mod.x_scale__mutmut_1")
    counts = mutation_report.tally(mutants, valid)["pkg/mod.py"]["counts"]
    assert (counts["killed"], counts["survived"], counts["equivalent"]) == (1, 1, 1)
    kill, raw, total = mutation_report.rates(counts)
    assert (kill, raw, total) == (1 / 2, 1 / 3, 3)


def test_pin_writes_the_current_line_into_unpinned_entries_only(mutants: Path, tmp_path: Path) -> None:
    listed = tmp_path / "equivalent.md"
    listed.write_text(
        "- `pkg.mod.x_scale__mutmut_1`: why.\n- `pkg.mod.xǁBoxǁsize__mutmut_1` (`return None`): why.\n",
        encoding="utf-8",
    )
    assert mutation_report.pin_entries(listed, mutants) == 1
    assert listed.read_text(encoding="utf-8").splitlines()[0] == "- `pkg.mod.x_scale__mutmut_1` (`return v / 2`): why."
    assert mutation_report.pin_entries(listed, mutants) == 0


