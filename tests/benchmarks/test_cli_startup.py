"""``benchmarks/cli_startup.py``: a commit's tree exported with ``git archive`` holds that commit's files, and timing a
``train.py`` command that fails names the command and the tree instead of timing it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import cli_startup


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=cli_startup.ROOT, capture_output=True, text=True, check=True).stdout


def test_export_writes_the_commits_tree(tmp_path: Path) -> None:
    try:
        head = _git("rev-parse", "HEAD").strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("not a git checkout")
    tree = cli_startup.export(head, tmp_path)
    assert (tree / "train.py").read_text() == _git("show", f"{head}:train.py")
    assert sorted(p.name for p in tree.iterdir()) == sorted(_git("ls-tree", "--name-only", head).split())


def test_a_failing_command_is_named_not_timed(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("import sys\nprint('bad flag', file=sys.stderr)\nsys.exit(2)\n")
    with pytest.raises(SystemExit, match=r"train.py --nope failed in .*: \['bad flag'\]"):
        cli_startup.seconds(tmp_path, ["--nope"])
    (tmp_path / "train.py").write_text("")
    assert 0 < cli_startup.seconds(tmp_path, []) < 60
    assert set(cli_startup.COMMANDS) == {"--help", "--print_config"}
