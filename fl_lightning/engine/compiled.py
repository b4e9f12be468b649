"""The stacked step without per-kernel launch overhead (``model.compile``; issue 42, item 1).

A stacked local step (``stacked.VectorizedContext``) is the gradient of every client's minibatch loss at once: on a
GPU a few hundred small kernels, each launched from Python, so a round of 50 steps is launch-bound long before the
card's arithmetic is busy. ``model.compile`` hands that step function to ``torch.compile``:

* ``none`` (default): eager, as before;
* ``compile``: TorchInductor fuses the step's forward, backward and loss into a few generated kernels
  (``torch.compile(fn, dynamic=False)``); it runs on the CPU too, which is where its equality tests run;
* ``cudagraphs``: the same, and the step is captured once as a CUDA graph and replayed at every later step
  (``mode="reduce-overhead"``): one launch per step. CUDA only.

Shapes are static by construction: a phase's plan pads every client's minibatch to the batch size and masks the
padding (``phases.plan_phase``), so all steps of a phase have one shape and compile once; a later round with the same
cohort size reuses the compiled code. A compiled step returns fresh tensors (graph outputs are copied out of the
graph's memory pool), so nothing a step returns is overwritten by the next replay. The optimiser update between steps
and the gather of each step's rows stay eager (they live in the stacked loop). The numbers equal the eager path's to
rounding (``tests/engine/test_compiled.py``: CPU ``compile``, and ``-m gpu`` for ``cudagraphs``).

The mode belongs to the network (``set_mode``, set by ``FederatedModule``), so that an algorithm never sees it and
the stacked path asks ``compiled_step`` for each phase's step function.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fl_lightning.errors import ConfigError

__all__ = ["CompileMode", "check_mode", "compiled_step", "mode_of", "set_mode"]

CompileMode = Literal["none", "compile", "cudagraphs"]
MODES: tuple[str, ...] = get_args(CompileMode)
#: ``torch.compile``'s backend for ``compile`` (tests swap in ``aot_eager``: the same capture, no code generation)
BACKEND = "inductor"

#: each network's mode (weak: a network that is gone takes its entry with it)
_MODES: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def check_mode(mode: str, device: torch.device | str | None = None) -> None:
    """One ``ConfigError`` line for a mode that does not exist, or ``cudagraphs`` on a device without CUDA."""
    if mode not in MODES:
        raise ConfigError(f"model.compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "cudagraphs" and device is not None and torch.device(device).type != "cuda":
        raise ConfigError(
            f"model.compile: cudagraphs captures CUDA graphs and the run is on {torch.device(device).type}; "
            "use model.compile: compile (or none) there"
        )


def set_mode(net: nn.Module, mode: str) -> str:
    """Compile ``net``'s stacked steps in ``mode`` from now on (``none``: eager); returns ``mode``."""
    check_mode(mode)
    _MODES[net] = mode
    return mode


def mode_of(net: nn.Module) -> str:
    return _MODES.get(net, "none")


def _fresh(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def compiled_step(fn: Callable, net: nn.Module) -> Callable:
    """``fn`` itself when ``net``'s mode is ``none``, else ``fn`` compiled in that mode (outputs copied out of a CUDA
    graph's pool). ``fn`` may be a new closure per phase: dynamo caches by code and guards on what it reads, so a
    phase of a shape and setting seen before reuses the compiled graph."""
    mode = mode_of(net)
    if mode == "none":
        return fn
    check_mode(mode, next(net.parameters()).device)  # cudagraphs off CUDA (train.py refuses it when parsing)
    if mode != "cudagraphs":
        return torch.compile(fn, dynamic=False, backend=BACKEND)
    compiled = torch.compile(fn, dynamic=False, mode="reduce-overhead")

    def replayed(*args: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()  # each call is one step: earlier outputs were copied out
        return tree_map(_fresh, compiled(*args))

    return replayed
