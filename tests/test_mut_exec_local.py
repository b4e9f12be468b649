"""``ClientContext.sgd`` and ``batches``, ``per_client`` and ``to_device`` (local.py) against hand-computed steps:
the phase's own learning rate and batch size, ``min_batch``, a custom step direction with a penalty, and
``channels_last`` batches and weights."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.client import ClientContext, ClientOptimizer, Penalty, loss_fn_for, per_client, to_device
from fl_lightning.models.split import SplitModel

Params = dict[str, Tensor]
HEAD = ["head.weight", "head.bias"]


def client(net: nn.Module, x: Tensor, y: Tensor, batch_size: int = 10, channels_last: bool = False) -> ClientContext:
    opt = ClientOptimizer(lr=0.01, momentum=0.5, batch_size=batch_size)
    gen = torch.Generator().manual_seed(0)
    return ClientContext(net, 0, x, y, None, opt, loss_fn_for(3), gen, channels_last=channels_last)


def ones_gradient(p: Params, x: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
    return {n: torch.ones_like(p[n]) for n in HEAD}, p["head.bias"].sum() * 0


def linear_client(n: int = 4, batch_size: int = 10) -> tuple[ClientContext, Params]:
    g = torch.Generator().manual_seed(1)
    net = SplitModel(nn.Identity(), nn.Linear(4, 3))
    ctx = client(net, torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g), batch_size)
    return ctx, {k: v.detach().clone() for k, v in net.named_parameters()}


def test_the_phases_learning_rate_replaces_the_rounds() -> None:
    ctx, params = linear_client()
    out = ctx.sgd(params, HEAD, 1, lr=0.5, gradient=ones_gradient)
    for n in params:
        assert_close_finite(out[n], params[n] - 0.5, rtol=1e-6, atol=1e-7)


def test_a_custom_step_direction_gets_the_penalty_gradient_added() -> None:
    ctx, params = linear_client()
    pen = Penalty(lambda p, d: 0.5 * (p["head.weight"] ** 2).sum() * d["c"], {"c": torch.tensor(2.0)})
    out = ctx.sgd(params, HEAD, 1, pen, gradient=ones_gradient)
    want = params["head.weight"] - 0.01 * (1 + 2.0 * params["head.weight"])
    assert_close_finite(out["head.weight"], want, rtol=1e-6, atol=1e-7)
    assert_close_finite(out["head.bias"], params["head.bias"] - 0.01, rtol=1e-6, atol=1e-7)


def test_the_phases_batch_size_sets_the_steps() -> None:
    ctx, params = linear_client(n=4, batch_size=10)
    ctx.sgd(params, HEAD, 1, batch_size=2)
    assert int(ctx.steps_taken) == 2  # 4 samples in batches of 2 (the optimiser's 10 would give 1)


def test_batches_smaller_than_min_batch_are_skipped() -> None:
    ctx, params = linear_client(n=5)
    ctx.sgd(params, HEAD, 1, batch_size=2, min_batch=2)
    assert int(ctx.steps_taken) == 2  # batches of 2, 2 and 1: the last is skipped


def test_channels_last_batches_and_weights() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 3, 4, 4, generator=g)
    net = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    ctx = client(net, x, torch.randint(0, 3, (3,), generator=g), channels_last=True)
    batch, labels = next(iter(ctx.batches()))
    assert batch.is_contiguous(memory_format=torch.channels_last) and not batch.is_contiguous()
    assert_close_finite(batch, x[torch.randperm(3, generator=torch.Generator().manual_seed(0))], rtol=0, atol=0)
    params = {k: v.detach().clone() for k, v in net.named_parameters()}
    out = ctx.sgd(params, ["2.weight", "2.bias"], 0)  # nothing trained: the copies as the context keeps them
    assert out["0.weight"].is_contiguous(memory_format=torch.channels_last) and not out["0.weight"].is_contiguous()
    assert_close_finite(out["0.weight"], params["0.weight"], rtol=0, atol=0)


def test_channels_last_leaves_flat_batches_alone() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, generator=g)
    ctx = client(nn.Linear(4, 3), x, torch.zeros(4, dtype=torch.long), channels_last=True)
    batch, _ = next(iter(ctx.batches()))
    assert batch.shape == (4, 4)
    assert_close_finite(batch, x[torch.randperm(4, generator=torch.Generator().manual_seed(0))], rtol=0, atol=0)


def test_a_0d_number_per_client_stays_0d() -> None:
    got = per_client(torch.tensor(2, dtype=torch.long), torch.ones((), dtype=torch.float64))
    assert got.shape == () and got.dtype == torch.float64 and got.item() == 2.0
    assert per_client(torch.tensor([1.0, 2.0]), torch.ones(2, 3)).shape == (2, 1)


class FakeTensor:
    """Records how ``to_device`` moves a tensor to an accelerator (no CUDA needed)."""

    def __init__(self) -> None:
        self.moves: list[tuple[tuple, dict]] = []
        self.pinned = False

    def pin_memory(self) -> FakeTensor:
        self.pinned = True
        return self

    def to(self, *args: object, **kwargs: object) -> FakeTensor:
        self.moves.append((args, kwargs))
        return self


@pytest.mark.parametrize("kind", ["cuda", "meta"])
def test_to_device_moves_to_the_device_it_is_given(kind: str) -> None:
    t, device = FakeTensor(), torch.device(kind, 0) if kind == "cuda" else torch.device(kind)
    to_device(t, device)
    assert t.pinned == (kind == "cuda")
    assert t.moves == [((device,), {"non_blocking": True} if kind == "cuda" else {})]
