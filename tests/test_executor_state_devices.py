"""The batched Adam state lives on its parameters' device. PyTorch's ``meta`` device stands in for a GPU here (no
GPU on the CI machine): a state tensor built without the parameter's device would land on the CPU, and the step
would then mix devices on a real GPU."""

from __future__ import annotations

import pytest
import torch

from fl_lightning.engine.stacked import BatchedAdam

HYPER = {"weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": True, "maximize": False}


@pytest.mark.parametrize("decoupled", [False, True])
def test_batched_adam_state_is_zero_per_client_and_on_the_parameters_device(decoupled: bool) -> None:
    rule = BatchedAdam(HYPER, decoupled)
    on_meta = rule.init(torch.empty(3, 4, 5, device="meta"))
    assert set(on_meta) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert all(t.device.type == "meta" for t in on_meta.values())
    on_cpu = rule.init(torch.randn(3, 4, 5))
    assert on_cpu["step"].shape == (3,) and not on_cpu["step"].any()  # one step count per client, all at 0
    assert all(t.shape == (3, 4, 5) and not t.any() for k, t in on_cpu.items() if k != "step")
