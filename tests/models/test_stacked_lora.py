"""The stacked multi-adapter step (``fl_lightning/models/stacked_lora.py``) against the per-client loop written here
in plain torch: K clients with their own LoRA adapters and heads, their losses, gradients and several SGD-with-
momentum steps equal the loop's to 1e-5, while the frozen base runs once per layer over all K clients' rows (not K
times) from the network's one copy; on CUDA too (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fl_lightning.models.stacked_lora import stacked_forward, stacked_loss, stacked_names
from tests.helpers.lora_refs import loaded
from tests.helpers.tiny_lora import tiny_net, token_batch

K = 4


def clients(net, device):
    """Each client's own adapter and head (drawn around the network's), its inputs and labels."""
    g = torch.Generator().manual_seed(5)
    names = stacked_names(net)
    base = dict(net.named_parameters())
    own = [{n: (base[n].detach().cpu() + 0.1 * torch.randn(base[n].shape, generator=g)).to(device) for n in names}
           for _ in range(K)]  # fmt: skip
    x = torch.stack([token_batch(6, seed=10 + k) for k in range(K)]).to(device)
    y = torch.randint(0, 2, (K, 6), generator=g).to(device)
    return names, own, x, y


def loop_steps(net, own, x, y, steps, lr=0.1, momentum=0.5):
    """The reference: each client alone, a copy of the network with its tensors, torch.optim.SGD over them."""
    out = []
    for k in range(K):
        model = loaded(net, own[k])
        chosen = [p for n, p in model.named_parameters() if n in own[k]]
        opt = torch.optim.SGD(chosen, lr=lr, momentum=momentum)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x[k]), y[k]).backward()
            opt.step()
        out.append({n: p.detach() for n, p in model.named_parameters() if n in own[k]})
    return out


def run(device):
    torch.manual_seed(0)
    net = tiny_net().to(device).eval()
    names, own, x, y = clients(net, device)
    stacked = {n: torch.stack([o[n] for o in own]).requires_grad_(True) for n in names}
    logits = stacked_forward(net, stacked, x)
    for k in range(K):  # forward: each client's logits are its own model's
        want = loaded(net, own[k])(x[k])
        torch.testing.assert_close(logits[k], want, rtol=1e-5, atol=1e-5)
    opt = torch.optim.SGD(list(stacked.values()), lr=0.1, momentum=0.5)
    for _ in range(3):
        opt.zero_grad()
        stacked_loss(net, stacked, x, y).backward()
        opt.step()
    want = loop_steps(net, own, x, y, steps=3)
    for k in range(K):
        for n in names:
            torch.testing.assert_close(stacked[n][k].detach(), want[k][n], rtol=1e-5, atol=1e-5, msg=n)
        moved = sum(float((stacked[n][k] - own[k][n]).abs().max()) for n in names)
        assert moved > 1e-3


def test_stacked_step_equals_the_per_client_loop():
    run("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stacked_step_equals_the_per_client_loop_on_cuda():
    run("cuda")


def test_the_base_runs_once_per_layer_for_all_clients_from_one_copy():
    net = tiny_net().eval()
    names, own, x, y = clients(net, "cpu")
    stacked = {n: torch.stack([o[n] for o in own]) for n in names}
    calls, ptrs = [], set()
    bases = [m for n, m in net.named_modules() if n.endswith("base_layer")]

    def seen(module, args, out):
        calls.append(args[0].shape[0] * args[0].shape[1])  # rows × tokens of the batch it multiplied
        ptrs.add(module.weight.data_ptr())

    hooks = [m.register_forward_hook(seen) for m in bases]
    try:
        stacked_forward(net, stacked, x)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(bases)  # one call per adapted layer, not K
    assert all(rows == K * x.shape[1] * x.shape[2] for rows in calls)  # every client's tokens in that one call
    assert ptrs == {m.weight.data_ptr() for m in bases}  # the network's own base weights
