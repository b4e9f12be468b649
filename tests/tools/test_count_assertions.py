"""``tools/count_assertions.py``: the checks a reorganisation of tests/ must keep, counted by syntax."""

from __future__ import annotations

from pathlib import Path

from tools.count_assertions import count_checks, main

SOURCE = '''
import numpy as np
import pytest


def assert_close_finite(a, b):  # a definition is not a check
    raise AssertionError


def test_a():
    assert 1 == 1, "message"
    with pytest.raises(ValueError, match="x"):
        int("x")
    with pytest.warns(UserWarning):
        pass
    np.testing.assert_allclose([1.0], [1.0])
    assert_close_finite(1.0, 1.0)
    pytest.raises(ValueError, int, "y")
    pytest.approx(1.0)  # not a check by itself
    helper_assert(1)  # only names that start with assert_ count


class TestB:
    def test_nested(self):
        for _ in range(3):
            assert True
'''


def test_each_kind_of_check_is_counted_once_and_definitions_are_not() -> None:
    # assert ×2, pytest.raises ×2, pytest.warns, np.testing.assert_allclose, assert_close_finite
    assert count_checks(SOURCE) == 7
    assert count_checks("def f():\n    return 1\n") == 0


def test_the_total_is_summed_over_every_python_file_below_a_path(tmp_path: Path, capsys) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "test_one.py").write_text(SOURCE)
    (tmp_path / "sub" / "test_two.py").write_text("def test_x():\n    assert 2 > 1\n")
    (tmp_path / "notes.md").write_text("assert nothing\n")
    assert main([str(tmp_path), "--per-file"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "8 checks in 2 files"
    assert sorted(line.split()[0] for line in lines[:-1]) == ["1", "7"]
