"""Shared helpers: small federated runs on the bundled digits and the synthetic linear data."""

from __future__ import annotations

import logging
import os
import sys

import lightning as L
import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(1)


def make_trainer(rounds: int, **kwargs) -> L.Trainer:
    defaults = dict(
        max_steps=rounds,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        num_sanity_val_steps=0,
        val_check_interval=1,  # as train.py: validation (every client evaluates) after every round
        check_val_every_n_epoch=None,
        use_distributed_sampler=False,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def fit(module, datamodule, rounds: int, seed: int = 0, **trainer_kwargs):
    """Seed, build, train for ``rounds`` rounds; returns the trained module."""
    L.seed_everything(seed, verbose=False)
    trainer = make_trainer(rounds, **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule)
    return module


@pytest.fixture(autouse=True, scope="session")
def _torchvision_reads_test_written_cifar():
    """Test-written CIFAR files cannot carry the published md5 sums: see ``data_fixtures.skip_cifar_md5``."""
    from data_fixtures import skip_cifar_md5

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
