"""``tools/ditto_side_by_side.py``: the reference loops' building blocks against the arithmetic written here: a
shuffled loader that drops the last partial minibatch, one plain SGD step with and without Ditto's proximal pull
μ(v − w), and a client's accuracy."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import ditto_side_by_side as side  # noqa: E402


def test_loader_is_a_permutation_in_full_minibatches_only():
    x, y = torch.arange(23.0).view(23, 1), torch.arange(23)
    batches = list(side.loader(x, y, 5, torch.Generator().manual_seed(0)))
    assert [len(b) for b, _ in batches] == [5, 5, 5, 5]  # 23 = 4 × 5 + 3: the last 3 are dropped
    seen = torch.cat([b for _, b in batches])
    assert len(set(seen.tolist())) == 20 and all(torch.equal(xb[:, 0].long(), yb) for xb, yb in batches)
    expected = torch.randperm(23, generator=torch.Generator().manual_seed(0))[:20]
    assert torch.equal(seen, expected)


def test_sgd_step_with_and_without_the_proximal_pull():
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    start = [p.detach().clone() for p in net.parameters()]
    anchor = [p + 0.5 for p in start]
    w, b = (p.clone().requires_grad_(True) for p in start)
    grads = torch.autograd.grad(nn.functional.cross_entropy(x @ w.T + b, y), [w, b])
    side.sgd_step(net, x, y, 0.1, anchor, 0.75)
    for p, p0, g, a in zip(net.parameters(), start, grads, anchor):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * (g + 0.75 * (p0 - a)))
    plain = nn.Linear(3, 2)
    plain.load_state_dict(dict(zip(["weight", "bias"], start)))
    side.sgd_step(plain, x, y, 0.1, None, 0.75)  # no anchor: μ plays no part
    for p, p0, g in zip(plain.parameters(), start, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g)


def test_client_accuracy_is_the_share_of_correct_argmaxes():
    net = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    assert side.client_accuracy(net, x, torch.tensor([0, 1, 1, 1])) == 0.75
