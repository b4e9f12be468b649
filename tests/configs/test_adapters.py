"""Every method of ``configs/adapters/`` runs from its shipped config through ``train.py`` (issue 43): the same
files as the README's example, with the pretrained model swapped for a tiny random BERT and the data for small
per-client folders written here, for 2 rounds; each run writes its summary and uploads what its method says."""

from __future__ import annotations

import json

import pytest

from tests.helpers.split_models import ROOT
from tests.helpers.tiny_lora import tiny_config, write_clients_hf, write_tokenizer
from tests.helpers.training import train_here

METHODS = sorted(p.stem for p in (ROOT / "configs" / "adapters").glob("*.yaml")
                 if p.stem != "base" and not p.stem.startswith("instruction_"))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_each_adapter_config_runs(method, tmp_path):
    data = write_clients_hf(tmp_path / "data", clients=4, train=6, test=4)
    tok = write_tokenizer(tmp_path / "tok")
    configs = ["--config", str(ROOT / "configs/adapters/base.yaml")]
    configs += ["--config", str(ROOT / f"configs/adapters/{method}.yaml")]
    args = [*configs,
            "--model.network.init_args.model", "null", "--model.network.init_args.layers", "null",
            "--model.network.init_args.config", json.dumps(tiny_config()),
            "--data.init_args.path", str(data), "--data.init_args.tokenizer", str(tok), "--data.init_args.num_clients",
            "4", "--data.init_args.clients_per_round", "2", "--data.init_args.max_length", "8",
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run")]  # fmt: skip
    assert train_here(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1 and summary["upload_bytes"] > 0


@pytest.mark.parametrize("method", [None, pytest.param("ffa_lora", marks=pytest.mark.slow),
                                    pytest.param("fedsa_lora", marks=pytest.mark.slow)])  # fmt: skip
def test_the_instruction_config_runs_on_the_data_its_command_writes(method, tmp_path):
    """``configs/adapters/instruction_fedit.yaml`` (FedIT; FFA-LoRA and FedSA-LoRA by adding their file) trains on the
    FedDPA-layout files ``python -m experiments instructions`` writes, on the stacked path, for 2 rounds."""
    from experiments.instructions import write_data

    data = write_data(tmp_path / "data", clients=4, train=4, test=2)
    configs = ["--config", str(ROOT / "configs/adapters/instruction_fedit.yaml")]
    if method is not None:
        configs += ["--config", str(ROOT / f"configs/adapters/{method}.yaml")]
    args = [*configs, "--data.init_args.path", str(data), "--data.init_args.tokenizer", str(data / "tokenizer"),
            "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.enable_progress_bar", "false",
            "--run_dir", str(tmp_path / "run")]  # fmt: skip
    assert train_here(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 2 and 0 <= summary["final"] <= 1 and summary["upload_bytes"] > 0
    assert summary["ran"]["executor"] == "stacked" and "LoRA adapters stacked" in summary["ran"]["reason"]
    assert summary["classes"] == 54  # the written tokenizer's vocabulary: one class per token
