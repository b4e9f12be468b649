"""The client optimisers written out for stacked parameters ``[K, ...]``: ``torch.optim.SGD``, ``Adam`` and ``AdamW``
step by step (``BatchedSGD``, ``BatchedAdam``), with a per-client step count and mask; ``batched_rule`` says which
client optimiser has a batched form (the others run client by client).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.client import (
    ClientOptimizer,
    Params,
)


def per_row(values: Tensor, like: Tensor) -> Tensor:
    """A ``[K]`` tensor shaped to broadcast against ``like`` ``[K, ...]`` (one value per client)."""
    return values.view(-1, *([1] * (like.dim() - 1)))


class BatchedSGD:
    """``torch.optim.SGD`` on stacked per-client tensors: ``d = g + λθ``; ``b = d`` on a state's first step, else
    ``b = μb + (1 − dampening)d``; ``θ ← θ − η(d + μb)`` with Nesterov, else ``θ ← θ − ηb``."""

    def __init__(self, hyper: dict) -> None:
        self.weight_decay, self.momentum, self.dampening = hyper["weight_decay"], hyper["momentum"], hyper["dampening"]
        self.nesterov, self.maximize = hyper["nesterov"], hyper["maximize"]
        self.keys = ("momentum_buffer",) if self.momentum else ()

    def init(self, p: Tensor) -> Params:
        return {"momentum_buffer": torch.zeros_like(p)} if self.momentum else {}

    def step(self, p: Tensor, g: Tensor, state: Params, count: Tensor, lr: float, wd: float) -> tuple[Tensor, Params]:
        d = -g if self.maximize else g
        if wd:
            d = d + wd * p
        if not self.momentum:
            return p - lr * d, {}
        if self.dampening:
            first = per_row(count == 0, p)
            buf = torch.where(first, d, self.momentum * state["momentum_buffer"] + (1 - self.dampening) * d)
        else:  # a fresh buffer is zero, so μ·0 + d = d is torch's first step exactly
            buf = self.momentum * state["momentum_buffer"] + d
        d = d + self.momentum * buf if self.nesterov else buf
        return p - lr * d, {"momentum_buffer": buf}

    @property
    def reads_count(self) -> bool:
        """Whether ``step`` reads the step count (dampening skips it on a buffer's first step)."""
        return bool(self.momentum and self.dampening)

    def step_all(
        self, ps: list[Tensor], gs: list[Tensor], states: list[Params], counts: list[Tensor], lr: float,
        decays: list[float],
    ) -> list[tuple[Tensor, Params]]:  # fmt: skip
        """``step`` of every parameter of a step; SGD with or without momentum (no dampening, Nesterov or
        maximize, one weight decay) as one ``torch._foreach`` op per term over the list, with ``step``'s values."""
        if self.dampening or self.nesterov or self.maximize or len(set(decays)) > 1:
            return step_each(self, ps, gs, states, counts, lr, decays)
        d = gs
        if decays and decays[0]:
            d = torch._foreach_add(gs, torch._foreach_mul(ps, decays[0]))
        if not self.momentum:
            return [(p, {}) for p in torch._foreach_sub(ps, torch._foreach_mul(d, lr))]
        bufs = torch._foreach_mul([s["momentum_buffer"] for s in states], self.momentum)
        torch._foreach_add_(bufs, d)
        return [(p, {"momentum_buffer": b}) for p, b in zip(torch._foreach_sub(ps, torch._foreach_mul(bufs, lr)), bufs)]


class BatchedAdam:
    """``torch.optim.Adam`` / ``AdamW`` on stacked per-client tensors, each client with its own step count t:
    ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²`` (``v̂ = max`` of all v with amsgrad),
    ``θ ← θ − η/(1−β₁ᵗ) · m / (√v̂/√(1−β₂ᵗ) + ε)``; weight decay adds ``λθ`` to g (Adam) or multiplies θ by
    ``1 − ηλ`` first (AdamW)."""

    def __init__(self, hyper: dict, decoupled: bool) -> None:
        self.weight_decay, (self.beta1, self.beta2) = hyper["weight_decay"], (float(b) for b in hyper["betas"])
        self.eps, self.amsgrad, self.maximize = hyper["eps"], hyper["amsgrad"], hyper["maximize"]
        self.decoupled = decoupled
        self.keys = ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def init(self, p: Tensor) -> Params:
        state = {"step": torch.zeros(p.shape[0], device=p.device)}
        state.update({k: torch.zeros_like(p) for k in self.keys[1:]})
        return state

    def step(self, p: Tensor, g: Tensor, state: Params, count: Tensor, lr: float, wd: float) -> tuple[Tensor, Params]:
        g = -g if self.maximize else g
        step = state["step"] + 1
        if wd and self.decoupled:
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        new = {"step": step, "exp_avg": torch.lerp(state["exp_avg"], g, 1 - self.beta1)}
        new["exp_avg_sq"] = state["exp_avg_sq"] * self.beta2 + (1 - self.beta2) * g * g
        second = new["exp_avg_sq"]
        if self.amsgrad:
            second = new["max_exp_avg_sq"] = torch.maximum(state["max_exp_avg_sq"], new["exp_avg_sq"])
        t = per_row(step.double(), p)
        step_size = (lr / (1 - self.beta1**t)).to(p.dtype)
        bias2_sqrt = ((1 - self.beta2**t) ** 0.5).to(p.dtype)
        return p - step_size * (new["exp_avg"] / (second.sqrt() / bias2_sqrt + self.eps)), new

    reads_count = False  # its own per-client ``step`` state counts

    def step_all(
        self, ps: list[Tensor], gs: list[Tensor], states: list[Params], counts: list[Tensor], lr: float,
        decays: list[float],
    ) -> list[tuple[Tensor, Params]]:  # fmt: skip
        return step_each(self, ps, gs, states, counts, lr, decays)


BatchedRule = BatchedSGD | BatchedAdam


def step_each(
    rule: BatchedRule, ps: list[Tensor], gs: list[Tensor], states: list[Params], counts: list[Tensor], lr: float,
    decays: list[float],
) -> list[tuple[Tensor, Params]]:  # fmt: skip
    """``rule.step`` of every parameter of a step, one after another (``step_all`` without a fused form)."""
    return [rule.step(p, g, s, c, lr, wd) for p, g, s, c, wd in zip(ps, gs, states, counts, decays)]


#: ``batched_rule``'s answers by the settings that decide them (a rule holds only hyper-parameters): the executor
#: asks every round, and each answer builds and steps a probe optimiser
_RULES: dict[tuple, BatchedRule | None] = {}


def batched_rule(settings: ClientOptimizer) -> BatchedRule | None:
    """The stacked-tensor version of the client optimiser, or None when there is none (remembered per settings)."""
    key = (settings.factory, settings.lr, settings.momentum, settings.weight_decay, settings.decay_bias)
    try:
        return _RULES[key]
    except KeyError:
        pass
    except TypeError:  # a factory that cannot be a key: asked every time
        return _probe_rule(settings)
    if len(_RULES) >= 256:
        _RULES.clear()
    _RULES[key] = rule = _probe_rule(settings)
    return rule


def _probe_rule(settings: ClientOptimizer) -> BatchedRule | None:
    probe = settings.probe()
    hyper = probe.defaults
    if hyper.get("differentiable") or isinstance(hyper.get("lr"), Tensor):
        return None
    if type(probe) is torch.optim.SGD:
        return BatchedSGD(hyper)
    if type(probe) in (torch.optim.Adam, torch.optim.AdamW):
        decoupled = type(probe) is torch.optim.AdamW or bool(hyper.get("decoupled_weight_decay", False))
        return BatchedAdam(hyper, decoupled)
    return None
