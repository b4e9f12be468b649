"""Fixtures for every test: one torch thread, W&B off, test-written CIFAR files, log handlers and the environment
restored (the builders themselves live in ``tests/helpers/``)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): the tests' child processes one thread each too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


#: where a test must never write: the repository's output folders (a user's own runs live there) and the fixed
#: paths that tests once used (root can create ``/nonexistent``); tests write under their ``tmp_path`` only
ROOT = Path(__file__).resolve().parents[1]
WATCHED = [*(ROOT / name for name in ("runs", "results", "wandb", "lightning_logs", "checkpoints")),
           Path("/nonexistent")]  # fmt: skip


def _tree(paths: list[Path]) -> dict[str, tuple[int, int]]:
    """``path -> (size, mtime_ns)`` of every file and folder under ``paths`` (absent paths: nothing)."""
    out: dict[str, tuple[int, int]] = {}
    for top in paths:
        for folder, dirs, files in os.walk(top):
            for name in [*dirs, *files]:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    out[path] = (st.st_size if name in files else 0, st.st_mtime_ns if name in files else 0)
        if top.exists() and not out:
            out[str(top)] = (0, 0)
    return out


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._watched_before = _tree(WATCHED)  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The guard of issue 45: a test run that created or changed anything in :data:`WATCHED` fails, naming it."""
    before = getattr(session.config, "_watched_before", None)
    if before is None:
        return
    after = _tree(WATCHED)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        print(f"\nerror: the tests wrote outside their temporary folders: {shown}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="session")
def _torchvision_reads_test_written_cifar():
    """Test-written CIFAR files cannot carry the published md5 sums: see ``helpers.data_fixtures.skip_cifar_md5``."""
    from tests.helpers.data_fixtures import skip_cifar_md5

    with pytest.MonkeyPatch.context() as patch:
        skip_cifar_md5(patch)
        yield


@pytest.fixture(autouse=True)
def _log_handlers_on_an_open_stream():
    """A ``StreamHandler`` keeps the ``sys.stderr`` of the moment it was made (Lightning makes one on import). When
    pytest runs several times in one process (mutmut: stats, clean run, then every mutant), that stream is an earlier
    run's closed capture, and each log line would print a "Logging error" traceback; point such handlers at the
    current ``sys.stderr``."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler and getattr(handler.stream, "closed", False):
                handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
    yield


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# a fixture of test_metrics.py and engine/test_aggregation.py (the ledger's byte counts)
from tests.helpers.split_models import fedper_run  # noqa: E402, F401
