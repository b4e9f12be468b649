"""Fixtures for every test: one torch thread, W&B off, test-written CIFAR files, log handlers and the environment
restored (the builders themselves live in ``tests/helpers/``)."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (make test): the tests' child processes one thread each too
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


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


# a fixture of test_metrics.py and engine/test_ledger.py
from tests.helpers.split_models import fedper_run  # noqa: E402, F401
