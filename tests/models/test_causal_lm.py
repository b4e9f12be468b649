"""``LoRACausalLM`` (``fl_lightning/models/causal_lm.py``) on a tiny random LLaMA (no download): ``head(body(x))`` is
the Hugging Face causal LM's next-token logits at each row's last real token with every LoRA update merged into its
weights (W + s·BA, written out here); only the adapters train (the LM head too with ``train_head``); and through the
engine FedIT, FFA-LoRA and FedSA-LoRA train on instruction data, the stacked path writing the loop's metrics to 1e-5,
the logged loss the token-level cross-entropy of the response tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from datamodules.instruction import InstructionDataModule
from fl_lightning.algorithms import FedIT, FedSALoRA, FFALoRA
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import LoRACausalLM
from fl_lightning.models.adapters import lora_pairs
from tests.helpers.tiny_instruction import tiny_llama_config, write_data
from tests.helpers.tiny_lora import draw_lora_b
from tests.helpers.training import fit


def tiny_lm(seed: int = 0, **kw) -> LoRACausalLM:
    """B drawn non-zero (peft starts it at 0) so the adapters change the outputs."""
    torch.manual_seed(seed)
    net = LoRACausalLM(config=tiny_llama_config(), rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], **kw)
    return draw_lora_b(net, seed + 1, scale=0.2)


def merged_reference(net: LoRACausalLM, seed: int = 0):
    """The causal LM built again from the same config and seed, each adapted weight replaced by W + s·B·A."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(tiny_llama_config())
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).eval()
    params = dict(net.named_parameters())
    own = dict(ref.named_parameters())
    scale = 8.0 / 4
    with torch.no_grad():
        for a, b, base in lora_pairs(net):
            name = base.split("base_model.model.", 1)[1].replace(".base_layer", "")  # layers.0.self_attn.q_proj.weight
            torch.testing.assert_close(own[f"model.{name}"], params[base])  # the same pretrained base
            own[f"model.{name}"].add_(scale * params[b] @ params[a])
    return ref


def test_the_next_token_logits_are_the_causal_lms_with_the_adapters_merged() -> None:
    net = tiny_lm().eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(3, 60, (4, 9), generator=g)
    lengths = [9, 5, 7, 2]
    for i, n in enumerate(lengths):  # right padding with id 0
        x[i, n:] = 0
    got = net(x)
    ref = merged_reference(net)
    for i, n in enumerate(lengths):
        want = ref(input_ids=x[i : i + 1, :n]).logits[0, -1]
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_only_the_adapters_train_unless_the_head_does() -> None:
    net = tiny_lm()
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert net.vocab_size == 96 and net.head.bias is None
    assert "head.weight" in {n for n, p in tiny_lm(train_head=True).named_parameters() if p.requires_grad}


def _data(tmp_path, seed: int = 0):
    root = write_data(tmp_path / "data", clients=4, train=4, test=2)
    return InstructionDataModule(str(root), str(root / "tokenizer"), num_clients=4, max_length=64, num_classes=96,
                                 clients_per_round=4, seed=seed)  # fmt: skip


def _fit(tmp_path, algorithm, executor: str):
    run = FederatedModule(algorithm, tiny_lm(), lr=0.05, momentum=0.5, batch_size=8, eval_last=1, executor=executor)
    fit(run, _data(tmp_path), rounds=2)
    return run, {k: float(v) for k, v in run.trainer.callback_metrics.items()}


@pytest.mark.parametrize("algorithm", [FedIT, pytest.param(FFALoRA, marks=pytest.mark.slow),
                                       pytest.param(FedSALoRA, marks=pytest.mark.slow)])  # fmt: skip
def test_adapter_methods_train_on_instruction_data_stacked_as_in_the_loop(tmp_path, algorithm) -> None:
    loop, want = _fit(tmp_path, algorithm(), "sequential")
    stacked, got = _fit(tmp_path, algorithm(), "vectorized")
    assert "train/loss" in want and "val/loss" in want and set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), k
    for (n, p), q in zip(loop.net.named_parameters(), stacked.net.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=n)
    # the logged test loss: each client's mean cross-entropy over its response tokens, averaged over the clients
    net, fed = copy.deepcopy(loop.net).eval(), loop.fed
    if algorithm is FedIT:  # one global model: every client scores with it
        with torch.no_grad():
            per_client = [float(F.cross_entropy(net(x), y)) for x, y in (fed.test.client(c) for c in range(4))]
        mean = sum(per_client) / 4
        assert want["val/loss"] == pytest.approx(mean, rel=1e-5) and math.exp(mean) > 1
