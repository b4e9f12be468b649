"""The multi-GPU plumbing that can be checked without a GPU (issue 16): the CLI's DDP strategy does not broadcast
buffers, one TF32 policy for train.py and the experiment runner, deterministic GPU trainer configs, Table-1 configs
evaluating every 10 rounds plus the last 10."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from fl_lightning.cli import distributed_strategy, set_tf32

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_the_cli_builds_ddp_without_the_per_forward_buffer_broadcast():
    from lightning.pytorch.strategies import DDPStrategy

    strategy = distributed_strategy({"strategy": "ddp"})["strategy"]
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs["broadcast_buffers"] is False
    assert distributed_strategy({"strategy": "auto"}) == {} and distributed_strategy({}) == {}


@pytest.fixture
def restore_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_one_tf32_policy_switches_cuda_matmuls_and_convolutions_together(restore_tf32):
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    set_tf32(False)
    # the legacy flags, not torch.get_float32_matmul_precision(): that getter raises once any earlier code in the
    # process has used the per-backend fp32_precision API (e.g. a second in-process pytest run under mutmut)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    set_tf32(True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu  # CPU math untouched


def test_train_py_and_the_experiment_runner_apply_the_policy_from_the_config(restore_tf32, tmp_path, monkeypatch):
    """Both go through ``cli.run``; ``--tf32`` is part of the run's config (and so of its saved config.yaml)."""
    from fl_lightning import cli

    seen = []
    monkeypatch.setattr(cli, "set_tf32", lambda enabled: seen.append(enabled))
    for value in ("false", "true"):
        cli.train_config(
            ["configs/quickstart.yaml"],
            ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
             "--model.eval_last=0", "--model.eval_every=100", f"--tf32={value}"],
            run_dir=tmp_path / value,
        )  # fmt: skip
    assert seen == [False, True]


@pytest.mark.parametrize("name", ["gpu", "multi_gpu", "slurm"])
def test_gpu_trainer_configs_are_deterministic(name):
    trainer = yaml.safe_load((CONFIGS / "trainer" / f"{name}.yaml").read_text())["trainer"]
    assert trainer["deterministic"] == "warn" and trainer["benchmark"] is False


def test_table1_configs_evaluate_every_10_rounds_and_the_last_10():
    columns = sorted((CONFIGS / "table1").glob("*.yaml"))
    assert len(columns) == 7
    for path in columns:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["trainer"]["val_check_interval"] == 10 and cfg["model"]["eval_last"] == 10, path.name
