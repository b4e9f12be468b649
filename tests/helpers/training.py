"""Short federated fits for the tests: a CPU trainer without logging or checkpoints, and ``fit``."""

from __future__ import annotations

import lightning as L


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


def train_here(args: list[str]) -> int:
    """``python train.py ARGS`` in this process (``fl_lightning.cli.main``; its return code). ``sys.argv`` holds only
    the program name meanwhile: LightningCLI warns when both its args and ``sys.argv`` are given."""
    import sys

    from fl_lightning.cli import main

    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return main(list(args))
    finally:
        sys.argv = argv
