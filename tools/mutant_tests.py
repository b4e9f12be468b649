"""Run chosen tests against named mutants, without touching mutmut's recorded verdicts.

mutmut compiles every mutant into ``mutants/`` and picks the active one from the ``MUTANT_UNDER_TEST``
environment variable. This script uses that switch directly: it copies ``tests/`` into ``mutants/tests`` (so a
test written or moved since the last ``mutmut run`` is there, and a moved one's stale copy is not), runs the given
pytest arguments once with no mutant (they must pass) and once per mutant, and prints ``killed`` or ``SURVIVED``
for each. It is safe beside a running
``mutmut run`` (it reads nothing mutmut writes); ``make mutation MUTANTS=NAME`` afterwards records the verdict.

    python tools/mutant_tests.py NAME [NAME ...] -- tests/engine/test_x.py [-k expr]

Exit status: 0 when every named mutant was killed, 1 otherwise, 2 when the tests fail without a mutant.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mutation_run import drop_stale_tests  # tools/ is this script's folder

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"


def run_tests(mutant: str, pytest_args: list[str]) -> int:
    """pytest's exit status with ``mutant`` active ("" = the original code), run from ``mutants/``."""
    env = dict(os.environ, MUTANT_UNDER_TEST=mutant, WANDB_MODE="disabled", PY_IGNORE_IMPORTMISMATCH="1")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    return subprocess.run(command, cwd=MUTANTS, env=env, **quiet).returncode


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == 0 or argv.index("--") == len(argv) - 1:
        print(__doc__.strip().splitlines()[-3].strip(), file=sys.stderr)
        return 2
    split = argv.index("--")
    names, pytest_args = argv[:split], argv[split + 1 :]
    if not MUTANTS.is_dir():
        print("no mutants/ folder: run `make mutation` first", file=sys.stderr)
        return 2
    drop_stale_tests(ROOT / "tests", MUTANTS / "tests")
    shutil.copytree(ROOT / "tests", MUTANTS / "tests", dirs_exist_ok=True)
    if run_tests("", pytest_args) != 0:
        print("the tests fail on the unmutated code; fix them first", file=sys.stderr)
        return 2
    survived = 0
    for name in names:
        killed = run_tests(name, pytest_args) != 0
        survived += not killed
        print(f"{'killed  ' if killed else 'SURVIVED'} {name}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
