"""``plan_phase`` step limits (``max_steps`` across epochs, straggler budgets, ``min_batch``) and two-column
augmentation draws, against generators replayed here; ``VectorizedContext`` with partly kept optimiser state and
with integer inputs (an embedding), against plain torch."""

from __future__ import annotations

import torch
from helpers import assert_close_finite
from torch import Tensor, nn
from torch.nn import functional as F

from fl_lightning.client import ClientOptimizer, state_name, state_template
from fl_lightning.engine.stacked import VectorizedContext, per_sample_loss_for, plan_phase, stack

CPU = torch.device("cpu")


class _TwoColumnDraws:
    """An augmentation that draws ahead two integers per sample (its ``apply`` is not used by a plan)."""

    def __call__(self, x: Tensor, g: torch.Generator) -> Tensor:
        return x

    def draw(self, n: int, g: torch.Generator) -> Tensor:
        return torch.randint(0, 100, (n, 2), generator=g)

    def apply(self, x: Tensor, drawn: Tensor) -> Tensor:
        return x


def test_max_steps_cut_inside_the_second_epoch_with_two_column_draws() -> None:
    """n = 5, batch 2, ``min_batch`` 2: 2 steps an epoch (the last single sample is skipped). ``max_steps`` = 3:
    epoch 1 gives 2 steps, epoch 2 one. Rows are offset by the client's start (10)."""
    g = torch.Generator().manual_seed(7)
    plan = plan_phase([5], [10], [g], [1.0], _TwoColumnDraws(), 2, 2, 2, 3, CPU)
    ref = torch.Generator().manual_seed(7)
    perm1 = torch.randperm(5, generator=ref)
    draw1 = torch.randint(0, 100, (5, 2), generator=ref)
    perm2 = torch.randperm(5, generator=ref)
    draw2 = torch.randint(0, 100, (5, 2), generator=ref)
    assert plan.host_steps == [3] and plan.steps.tolist() == [3]
    assert plan.lengths == [[2, 2, 2]]
    want_rows = [perm1[0:2] + 10, perm1[2:4] + 10, perm2[0:2] + 10]
    assert plan.rows.shape == (3, 1, 2)
    for s in range(3):
        assert plan.rows[s, 0].tolist() == want_rows[s].tolist()
    assert plan.draws is not None and plan.draws.shape == (3, 1, 2, 2)
    want_draws = [draw1[0:2], draw1[2:4], draw2[0:2]]
    for s in range(3):
        assert plan.draws[s, 0].tolist() == want_draws[s].tolist()
    assert torch.equal(g.get_state(), ref.get_state())  # exactly two epochs were drawn


def test_a_straggler_budget_caps_steps_and_draws_no_further_epoch() -> None:
    """Budget 0.5 of 2 epochs of 2 steps (n = 5, batch 2, ``min_batch`` 2) is 2 steps: all in epoch 1, so the
    generator draws one shuffle only."""
    g = torch.Generator().manual_seed(3)
    plan = plan_phase([5], [0], [g], [0.5], None, 2, 2, 2, None, CPU)
    ref = torch.Generator().manual_seed(3)
    perm = torch.randperm(5, generator=ref)
    assert plan.host_steps == [2] and plan.lengths == [[2, 2]] and plan.draws is None
    assert plan.rows[:, 0].tolist() == [perm[0:2].tolist(), perm[2:4].tolist()]
    assert torch.equal(g.get_state(), ref.get_state())


def test_a_straggler_budget_with_a_kept_partial_batch() -> None:
    """``min_batch`` 1: n = 5, batch 2 is 3 steps an epoch; budget 0.5 of 2 epochs is 3 steps (batches 2, 2, 1)."""
    g = torch.Generator().manual_seed(4)
    plan = plan_phase([5], [0], [g], [0.5], None, 2, 2, 1, None, CPU)
    ref = torch.Generator().manual_seed(4)
    perm = torch.randperm(5, generator=ref)
    assert plan.host_steps == [3] and plan.lengths == [[2, 2, 1]]
    assert plan.rows[:, 0].tolist() == [perm[0:2].tolist(), perm[2:4].tolist(), [int(perm[4]), -1]]
    assert torch.equal(g.get_state(), ref.get_state())


def test_partly_kept_optimizer_state_is_updated_for_every_kept_parameter() -> None:
    """Kept momentum state for ``bias`` only (``weight`` starts fresh and is not kept), trainable order weight,
    bias: after two full-batch steps the kept bias buffer and step count are torch SGD's (momentum 0.5)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, generator=g), torch.randn(3, 3, generator=g)]
    ys = [torch.tensor([0, 1, 1, 0]), torch.tensor([1, 0, 1])]
    net = nn.Linear(3, 2)
    params = {n: torch.randn(2, *p.shape, generator=g) * 0.5 for n, p in net.named_parameters()}
    optimizer = ClientOptimizer(lr=0.1, batch_size=10)
    template = state_template(optimizer, {n: p.detach() for n, p in net.named_parameters()})
    kept = {k: v for k, v in template.items() if k.endswith(".bias")}
    gens = [torch.Generator().manual_seed(5 + i) for i in range(2)]
    ctx = VectorizedContext(net, range(2), xs, ys, None, optimizer, per_sample_loss_for(2), gens, None, 0, 0,
                            [1.0, 1.0])  # fmt: skip
    ctx.optimizer_state = stack([kept, kept])
    got = ctx.sgd(dict(params), ["weight", "bias"], 2)
    state = ctx.optimizer_state
    assert state is not None
    assert state[state_name("steps", "bias")].tolist() == [2, 2]
    assert not any(k.endswith(".weight") for k in state)
    for k in range(2):
        leaves = {n: v[k].clone().requires_grad_(True) for n, v in params.items()}
        opt = torch.optim.SGD([leaves["weight"], leaves["bias"]], lr=0.1, momentum=0.5)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(xs[k] @ leaves["weight"].T + leaves["bias"], ys[k]).backward()
            opt.step()
        buf = opt.state[leaves["bias"]]["momentum_buffer"]
        assert_close_finite(state[state_name("momentum_buffer", "bias")][k], buf, rtol=1e-5, atol=1e-6)
        for n in params:
            assert_close_finite(got[n][k], leaves[n].detach(), rtol=1e-5, atol=1e-6)


def test_integer_inputs_report_a_floating_training_loss() -> None:
    """Token ids through an embedding: the phase's loss is the float mean cross-entropy of the one full-batch step
    (not truncated to an integer), each client's at its starting parameters."""
    net = nn.Sequential(nn.Embedding(6, 3), nn.Flatten(), nn.Linear(3, 2))
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(2, *p.shape, generator=g) for n, p in net.named_parameters()}
    xs = [torch.tensor([[0], [3], [5]]), torch.tensor([[1], [2]])]
    ys = [torch.tensor([0, 1, 1]), torch.tensor([1, 0])]
    gens = [torch.Generator().manual_seed(5 + i) for i in range(2)]
    ctx = VectorizedContext(net, range(2), xs, ys, None, ClientOptimizer(lr=0.1, batch_size=10),
                            per_sample_loss_for(2), gens, None, 0, 0, [1.0, 1.0])  # fmt: skip
    ctx.sgd(dict(params), list(params), 1)
    want = []
    for k in range(2):
        emb = params["0.weight"][k][xs[k][:, 0]]
        logits = emb @ params["2.weight"][k].T + params["2.bias"][k]
        want.append(float(F.cross_entropy(logits, ys[k])))
    loss = torch.as_tensor(ctx.train_loss)
    assert loss.is_floating_point()
    assert_close_finite(loss, torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_custom_gradient_gets_unit_weights_on_the_batch_device() -> None:
    """``_set_gradient`` hands the custom gradient one weight of 1 per row, on the rows' device (``meta`` stands in
    for an accelerator), and sets every leaf's ``grad`` to what it returns."""
    from types import SimpleNamespace

    from fl_lightning.client import ClientContext

    seen: list[Tensor] = []

    def gradient(values: dict[str, Tensor], x: Tensor, y: Tensor, w: Tensor) -> tuple[dict[str, Tensor], Tensor]:
        seen.append(w)
        return {"a": 2.0 * values["a"]}, (w * 0.5).sum()

    for device in ("cpu", "meta"):
        a = torch.tensor([1.0, -3.0], device=device)
        leaf = a.clone().requires_grad_(True)
        x, y = torch.zeros(3, 2, device=device), torch.zeros(3, device=device)
        ctx = SimpleNamespace(net=nn.Identity())  # a network without BatchNorm layers
        loss = ClientContext._set_gradient(ctx, gradient, None, {"a": a}, {"a": leaf}, x, y)  # type: ignore[arg-type]
        assert seen[-1].device.type == device and seen[-1].shape == (3,)
        assert leaf.grad is not None and leaf.grad.device.type == device
        if device == "cpu":
            assert seen[-1].tolist() == [1.0, 1.0, 1.0]
            assert float(loss) == 1.5 and leaf.grad.tolist() == [2.0, -6.0]
