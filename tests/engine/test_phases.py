"""``fl_lightning/engine/phases.py``: a phase's minibatch plan (``plan_phase``) and ``stack``, against the draws each
client's own generator makes."""

from __future__ import annotations

import torch
from torch import Tensor

from fl_lightning.engine.phases import plan_phase
from fl_lightning.engine.stacked_nets import stack
from tests.engine.test_stacked import DoublingAhead


# ---- plan_phase and stack ---------------------------------------------------------------------------------------
def test_a_plan_for_no_clients_has_no_steps() -> None:
    plan = plan_phase([], [], [], [], None, 2, 3, 1, None, torch.device("cpu"))
    assert plan.num_steps == 0 and plan.rows.shape == (0, 0, 3) and plan.rows.dtype == torch.long
    assert plan.steps.dtype == torch.long and plan.steps.shape == (0,) and plan.draws is None


def test_one_clients_one_draw_per_sample_is_planned() -> None:
    g = torch.Generator().manual_seed(3)
    plan = plan_phase([1], [0], [g], [1.0], DoublingAhead(), 1, 1, 1, None, torch.device("cpu"))
    expected = torch.Generator().manual_seed(3)
    torch.randperm(1, generator=expected)
    drawn = torch.randint(0, 5, (1, 1), generator=expected)
    assert plan.rows.tolist() == [[[0]]] and plan.steps.tolist() == [1]
    assert plan.draws is not None and plan.draws.shape == (1, 1, 1, 1)
    assert plan.draws.dtype == torch.long and plan.draws.view(-1).tolist() == drawn.view(-1).tolist()


def test_draws_are_planned_when_the_first_client_takes_no_step() -> None:
    """Client 0 has no sample (no step, no draw), client 1 three: the plan still carries client 1's draws (the draw
    width comes from a client that drew), and client 0's slots are padding."""
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(4)]
    plan = plan_phase([0, 3], [0, 0], gens, [1.0, 1.0], DoublingAhead(), 1, 3, 1, None, torch.device("cpu"))
    expected = torch.Generator().manual_seed(4)
    perm = torch.randperm(3, generator=expected)
    drawn = torch.randint(0, 5, (3, 1), generator=expected)
    assert plan.host_steps == [0, 1] and plan.rows[0, 0].tolist() == [-1, -1, -1]
    assert plan.rows[0, 1].tolist() == perm.tolist()
    assert plan.draws is not None and plan.draws.shape == (1, 2, 3, 1)
    assert plan.draws[0, 1].view(-1).tolist() == drawn.view(-1).tolist()


def test_padding_rows_are_minus_one() -> None:
    gens = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    plan = plan_phase([3, 1], [0, 3], gens, [1.0, 1.0], None, 1, 2, 1, None, torch.device("cpu"))
    assert plan.host_steps == [2, 1] and plan.lengths == [[2, 1], [1]]
    rows = plan.rows
    assert sorted(rows[:, 0].flatten().tolist()) == [-1, 0, 1, 2]  # client 0: its 3 rows, one padding slot
    assert rows[1, 0, 1].item() == -1  # the partial batch's padding
    assert rows[0, 1].tolist() == [3, -1] and rows[1, 1].tolist() == [-1, -1]  # client 1: one row, then a pad step


def test_stacking_nothing_gives_nothing() -> None:
    assert stack([]) == {}
    assert stack([{"a": torch.ones(2)}, {"a": torch.zeros(2)}])["a"].tolist() == [[1.0, 1.0], [0.0, 0.0]]


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


def test_a_plan_with_a_cap_per_client_and_each_clients_last_epoch() -> None:
    """Sizes 5, 3, 0 in batches of 2 over 2 epochs (3, 2 and 0 batches per epoch), caps 4, none, none: 4, 4 and 0
    steps; the last epoch with a step starts at step 3 (client 0's second epoch has one step), 2, and 0 for the
    client without steps; on the host and on the device."""
    gens = [torch.Generator().manual_seed(k) for k in range(3)]
    plan = plan_phase([5, 3, 0], [0, 5, 8], gens, [1.0] * 3, None, 2, 2, 1, [4, None, None], torch.device("cpu"))
    assert plan.host_steps == [4, 4, 0] and plan.steps.tolist() == [4, 4, 0]
    assert plan.host_last_epoch == [3, 2, 0]
    assert plan.last_epoch is not None and plan.last_epoch.tolist() == [3, 2, 0]
    assert plan.lengths == [[2, 2, 1, 2], [2, 1, 2, 1], []]


def test_a_batch_size_above_every_clients_data_pads_only_to_the_longest_minibatch() -> None:
    """Batch size 10 000 (full-batch training) over clients of 3 and 5 samples: one step each, 5 columns (client 0's
    last two padding), not 10 000: a stacked transformer step runs the cohort's real rows, not the batch size."""
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    plan = plan_phase([3, 5], [0, 3], gens, [1.0, 1.0], None, 1, 10_000, 1, None, CPU)
    perms = [torch.randperm(3, generator=torch.Generator().manual_seed(1)),
             torch.randperm(5, generator=torch.Generator().manual_seed(2)) + 3]  # fmt: skip
    assert plan.rows.shape == (1, 2, 5) and plan.lengths == [[3], [5]]
    assert plan.rows[0, 0].tolist() == [*perms[0].tolist(), -1, -1] and plan.rows[0, 1].tolist() == perms[1].tolist()
