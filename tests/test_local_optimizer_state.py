"""Unit tests of the client optimiser plumbing in ``fl_lightning.client``: bias groups without weight decay,
moving kept optimiser state into and out of a ``torch.optim`` optimiser (``load_state`` / ``save_state``), and
the attributes a fresh ``ClientContext`` reports before any phase has run.

The references are plain torch: an SGD update written out by hand, and the kept state's tensors built by hand.
The ``meta`` device stands in for an accelerator where a test pins which device a tensor ends up on (the CPU and
the leaf's device are then different, as on a GPU).
"""

from __future__ import annotations

import functools

import torch
from helpers import assert_close_finite
from torch import nn
from torch.nn import functional as F

from fl_lightning.client import ClientContext, ClientOptimizer, load_state, save_state, state_name, state_template
from fl_lightning.engine.rounds import make_generator


def test_decay_bias_false_decays_weights_but_not_biases() -> None:
    """``decay_bias=False``: the weight steps with weight decay, the bias without; each parameter is in exactly one
    group (plain SGD, no momentum, so one step is ``p − lr·(g + wd·p)`` for the weight and ``p − lr·g`` for the
    bias)."""
    lr, wd = 0.1, 0.5
    w = torch.tensor([[1.0, -2.0], [0.5, 3.0]], requires_grad=True)
    b = torch.tensor([2.0, -1.0], requires_grad=True)
    opt = ClientOptimizer(lr=lr, momentum=0.0, weight_decay=wd, decay_bias=False).build({"fc.weight": w, "fc.bias": b})
    gw, gb = torch.tensor([[0.1, 0.2], [0.3, 0.4]]), torch.tensor([1.0, 2.0])
    w0, b0 = w.detach().clone(), b.detach().clone()
    w.grad, b.grad = gw.clone(), gb.clone()
    opt.step()
    assert_close_finite(w.detach(), w0 - lr * (gw + wd * w0))
    assert_close_finite(b.detach(), b0 - lr * gb)
    counts = [len(g["params"]) for g in opt.param_groups]
    assert counts == [1, 1]


def _kept(name: str, steps: int, step: float, avg: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        state_name("steps", name): torch.tensor(steps, dtype=torch.long),
        state_name("step", name): torch.tensor(step),
        state_name("exp_avg", name): avg.clone(),
    }


def _group_opt(leaf: torch.Tensor, **flags: bool) -> torch.optim.Optimizer:
    """An optimiser whose only group carries ``flags`` (``fused``, ``capturable``), as torch's Adam sets them."""
    opt = torch.optim.SGD([leaf], lr=0.1)
    opt.param_groups[0].update(flags)
    return opt


def test_load_state_puts_scalar_state_on_the_cpu_unless_fused_or_capturable() -> None:
    """Scalar state (Adam's ``step``) goes to the CPU for a plain group and to the leaf's device for a fused or
    a capturable group; tensor state keeps its values; a leaf that never stepped gets no state."""
    avg = torch.tensor([0.25, -0.5, 1.5])
    cases: list[tuple[dict[str, bool], str]] = [
        ({}, "cpu"),
        ({"fused": True}, "meta"),
        ({"capturable": True}, "meta"),
        ({"fused": True, "capturable": False}, "meta"),
        ({"fused": False, "capturable": True}, "meta"),
    ]
    for flags, device in cases:
        leaf = torch.empty(3, device="meta", requires_grad=True)
        opt = _group_opt(leaf, **flags)
        load_state(opt, {"w": leaf}, _kept("w", 4, 4.0, avg))
        state = opt.state[leaf]
        assert sorted(state) == ["exp_avg", "step"]
        assert state["step"].device.type == device, flags
        assert state["step"].dim() == 0
        if device == "cpu":
            assert float(state["step"]) == 4.0
        assert state["exp_avg"].device.type == "cpu"
        assert_close_finite(state["exp_avg"], avg)


def test_load_state_scalar_state_values_and_fresh_leaves_on_the_cpu() -> None:
    """On the CPU: the loaded state equals the kept one (copies, not the kept tensors themselves), and a leaf whose
    kept step counter is 0 starts fresh."""
    a = torch.zeros(3, requires_grad=True)
    b = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1)
    kept = {**_kept("a", 2, 2.0, torch.tensor([1.0, 2.0, 3.0])), **_kept("b", 0, 0.0, torch.zeros(3))}
    load_state(opt, {"a": a, "b": b}, kept)
    assert b not in opt.state or not opt.state[b]
    assert float(opt.state[a]["step"]) == 2.0
    assert_close_finite(opt.state[a]["exp_avg"], torch.tensor([1.0, 2.0, 3.0]))
    assert opt.state[a]["exp_avg"].data_ptr() != kept[state_name("exp_avg", "a")].data_ptr()


def _momentum_kept(names: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for n in names:
        out[state_name("steps", n)] = torch.tensor(3, dtype=torch.long)
        out[state_name("momentum_buffer", n)] = torch.full((2,), 7.0)
    return out


def test_save_state_skips_a_leaf_without_state_and_saves_the_next() -> None:
    """A leaf the phase never gave a gradient keeps its kept state; the leaves after it are still saved (counter +
    steps, buffer = the optimiser's)."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    opt.state[b]["momentum_buffer"] = torch.tensor([1.0, -1.0])
    kept = _momentum_kept(["a", "b"])
    out = save_state(opt, {"a": a, "b": b}, kept, steps=5)
    assert int(out[state_name("steps", "a")]) == 3
    assert_close_finite(out[state_name("momentum_buffer", "a")], torch.full((2,), 7.0))
    assert int(out[state_name("steps", "b")]) == 8
    assert_close_finite(out[state_name("momentum_buffer", "b")], torch.tensor([1.0, -1.0]))


def test_save_state_casts_to_the_kept_dtype_and_device() -> None:
    """Saved state takes the kept tensor's dtype (float64 optimiser state into a float32 bank) and device (CPU
    state into a bank on another device goes to the bank's device)."""
    a = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    opt.state[a]["momentum_buffer"] = torch.tensor([0.5, 1.0 + 1e-12], dtype=torch.float64)
    out = save_state(opt, {"a": a}, _momentum_kept(["a"]), steps=1)
    buf = out[state_name("momentum_buffer", "a")]
    assert buf.dtype == torch.float32
    assert_close_finite(buf, torch.tensor([0.5, 1.0], dtype=torch.float32))

    m = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([m], lr=0.1, momentum=0.9)
    opt.state[m]["momentum_buffer"] = torch.tensor([1.0, 2.0], dtype=torch.float64)
    kept = _momentum_kept(["m"])
    kept[state_name("momentum_buffer", "m")] = torch.empty(2, device="meta")
    out = save_state(opt, {"m": m}, kept, steps=1)
    buf = out[state_name("momentum_buffer", "m")]
    assert (buf.device.type, buf.dtype, tuple(buf.shape)) == ("meta", torch.float32, (2,))
    assert int(out[state_name("steps", "m")]) == 4


def test_fresh_client_context_reports_no_loss_no_steps_and_no_kept_state() -> None:
    """Before any phase (and after a phase with nothing to train) a client reports loss 0, zero steps as an integer
    tensor, and no kept optimiser state; the phase returns the parameters unchanged."""
    net = nn.Linear(3, 2)
    x, y = torch.ones(4, 3), torch.tensor([0, 1, 0, 1])
    ctx = ClientContext(net, 0, x, y, None, ClientOptimizer(), F.cross_entropy, make_generator(0, "t", 0, 0))
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    out = ctx.sgd(params, [], epochs=1)
    for n, v in params.items():
        assert torch.equal(out[n], v)
    assert isinstance(ctx.train_loss, float | torch.Tensor)
    assert float(ctx.train_loss) == 0.0
    assert ctx.steps_taken.dtype == torch.long
    assert int(ctx.steps_taken) == 0
    assert ctx.optimizer_state is None


class _Linear(nn.Linear):
    """``nn.Linear(3, 2)`` with the engine's forward signature (``side`` information, unused)."""

    def __init__(self) -> None:
        super().__init__(3, 2)

    def forward(self, x: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


def test_kept_state_takes_the_parameter_dtype_and_continues_adam_in_float64() -> None:
    """A float64 network with kept Adam state (as the linear algorithms run outside ``precision: 64-true``): the
    template's elementwise state is float64 like the parameters, the scalar ``step`` keeps torch's scalar dtype, and
    two full-batch phases continue one plain ``torch.optim.Adam`` run over the same two steps."""
    torch.manual_seed(0)
    net = _Linear().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])
    optimizer = ClientOptimizer.from_config(functools.partial(torch.optim.Adam, lr=0.05), batch_size=6)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    template = state_template(optimizer, params)
    for n, p in params.items():
        assert template[state_name("exp_avg", n)].dtype == torch.float64
        assert template[state_name("exp_avg_sq", n)].shape == p.shape
        assert template[state_name("step", n)].dtype == torch.get_default_dtype()
        assert template[state_name("steps", n)].dtype == torch.long
    ctx = ClientContext(net, 0, x, y, None, optimizer, F.cross_entropy, make_generator(0, "t", 0, 0))
    ctx.optimizer_state = template
    out = ctx.sgd(ctx.sgd(params, list(params), epochs=1), list(params), epochs=1)

    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    reference = torch.optim.Adam(list(leaves.values()), lr=0.05)
    for _ in range(2):
        reference.zero_grad()
        F.cross_entropy(x @ leaves["weight"].T + leaves["bias"], y).backward()
        reference.step()
    for n, leaf in leaves.items():
        assert out[n].dtype == torch.float64
        assert_close_finite(out[n], leaf.detach(), rtol=1e-12, atol=1e-12)
        assert_close_finite(ctx.optimizer_state[state_name("exp_avg", n)], reference.state[leaf]["exp_avg"])
        assert int(ctx.optimizer_state[state_name("steps", n)]) == 2
