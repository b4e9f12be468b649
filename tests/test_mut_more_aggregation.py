"""``add_delta`` keeps the value's dtype, ``server_step`` passes only uploads outside the model to
``server_update``, and ``collect`` counts sample sizes above float32's exact range exactly."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fl_lightning.algorithms.base import ClientUpdate
from fl_lightning.engine.aggregation import RoundStats, add_delta, collect, server_step
from fl_lightning.engine.ledger import CommunicationLedger


def test_add_delta_keeps_a_float32_value_float32() -> None:
    out = add_delta(torch.tensor([1.0, 2.0]), torch.tensor([0.5, -0.25], dtype=torch.float64))
    assert out.dtype == torch.float32 and out.tolist() == [1.5, 1.75]


def test_add_delta_rounds_into_an_integer_buffer() -> None:
    out = add_delta(torch.tensor([3, 10]), torch.tensor([1.6, -2.4], dtype=torch.float64))
    assert out.dtype == torch.long and out.tolist() == [5, 8]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[set[str], dict[str, Tensor], int]] = []

    def server_update(self, state: dict[str, Tensor], extra: dict[str, Tensor], round_idx: int) -> None:
        self.calls.append((set(state), dict(extra), round_idx))


def test_server_step_hands_only_the_extra_uploads_to_the_algorithm() -> None:
    """One parameter (stepped by SGD lr 1 on −Δ: ``w + Δ``), one buffer (``+ Δ``), one upload outside the model."""
    net = nn.Module()
    net.w = nn.Parameter(torch.tensor([1.0, 2.0]))
    net.register_buffer("b", torch.tensor([5.0]))
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    algo = _Recorder()
    upd = {"w": torch.tensor([0.5, -1.0]), "b": torch.tensor([2.0]), "c": torch.tensor([7.0])}
    server_step(net, opt, algo, upd, 3)  # type: ignore[arg-type]
    assert net.w.detach().tolist() == [1.5, 1.0] and net.b.tolist() == [7.0]
    ((state, extra, round_idx),) = algo.calls
    assert state == {"w", "b"} and round_idx == 3
    assert set(extra) == {"c"} and extra["c"].tolist() == [7.0]


def test_collect_counts_sample_sizes_beyond_float32_exactly() -> None:
    """Two clients with 2**24 + 1 and 2 samples: weight and sample counts 2**24 + 3 (not a float32 number)."""
    big = 2**24 + 1
    template: dict[str, Any] = {"w": torch.zeros(1)}
    ups = [ClientUpdate({"w": torch.tensor([1.0])}, {}, n, 0.0) for n in (big, 2)]
    ledger = CommunicationLedger((), (), (), list(template))
    sums = collect(0, [0, 1], [0, 1], [0, 1], ups, {"w": torch.zeros(1)}, template, {}, ledger, "num_samples",
                   RoundStats(), "Algo")  # fmt: skip
    assert sums.counts is not None
    assert sums.counts[0].item() == big + 2 and sums.counts[2].item() == big + 2
