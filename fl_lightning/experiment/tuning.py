"""Grid extension for the tuning stage (issue 44): a winner on the edge of a numeric axis is not a tuned value.

After the tuning runs of a grid are chosen from (``runner.choose``), every numeric axis of a method's winner is
checked: the winner sits on the *lower* (*upper*) edge when its value is the smallest (largest) value of that axis
tried so far. For each such edge the next value outward is added as one new point, at the winner's values of the
other axes, and run with the method's tuning seeds; then the method chooses again. This repeats until the winner is
interior on every numeric axis, or one of these stops it, which the winner then carries as its flag:

* ``budget``: the method has used its ``extend`` extensions (the same number for every method: one extension is one
  round of new points, at most one per edge axis, each × the tuning seeds);
* ``bound``: the next value would leave the axis's declared bounds (``tune.bounds``; default ``[0, ∞)`` for an axis
  of non-negative values, ``[1, ∞)`` for one of positive integers). A step that crosses a bound is clipped to it
  once (so ``mu`` can reach 0), after which the bound stops it.

The next value is on the axis's own scale (``tune.scale``): ``log`` multiplies the edge value by the ratio of the
two outermost values on that side (0.01, 0.05 → 0.25 above, 0.002 below), ``linear`` adds their difference (1, 5 →
9 above; integers stay integers). By default an axis is ``log`` when all its values are positive and it is a
learning rate (a key ending in ``lr``) or a grid of at least three values in constant ratio; otherwise ``linear``.
A new point whose run fails (a diverged run stops with an error) counts as tried and lost: it cannot win, and the
axis is no longer at that edge.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from fl_lightning.experiment.spec import AxisValue, Choice, Experiment, Outcome, RunSpec, Tune, TuneRun, arg_value


@dataclass(frozen=True)
class Edge:
    """A numeric axis on which a method's winner sits at the edge of the values tried."""

    key: str
    side: str  # "lower" or "upper"
    value: Any
    next_value: Any | None  # None: a bound or the budget stops it
    stop: str = ""  # why next_value is None: "bound 0", "budget (2 extensions)"

    def flag(self) -> str:
        leaf = self.key.rsplit(".", 1)[-1]
        return f"{leaf}={arg_value(self.value)} at the {self.side} edge ({self.stop})"


def is_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def is_lr(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return leaf == "lr" or leaf.endswith("_lr")


def axis_scale(key: str, values: Sequence[Any], declared: Mapping[str, str]) -> str:
    """``log`` or ``linear`` for the axis ``key`` whose grid is ``values`` (module docstring)."""
    if key in declared:
        return declared[key]
    nums = sorted(values)
    if not nums or nums[0] <= 0:
        return "linear"
    if is_lr(key):
        return "log"
    ratios = [b / a for a, b in zip(nums, nums[1:])]
    return "log" if len(nums) >= 3 and max(ratios) - min(ratios) <= 1e-9 * max(ratios) else "linear"


def axis_bounds(key: str, values: Sequence[Any], declared: Mapping[str, tuple[float | None, float | None]]
                ) -> tuple[float | None, float | None]:  # fmt: skip
    """The values ``extend`` may reach on the axis (module docstring)."""
    if key in declared:
        return declared[key]
    if all(isinstance(v, int) for v in values) and min(values) >= 1:
        return 1, None
    return (0, None) if min(values) >= 0 else (None, None)


def outward(values: Sequence[Any], side: str, scale: str, bounds: tuple[float | None, float | None]
            ) -> tuple[Any | None, str]:  # fmt: skip
    """The next value beyond the ``side`` edge of the sorted distinct ``values`` (≥ 2 of them), or None and the
    bound that stops it."""
    nums = sorted(set(values))
    edge, inner = (nums[0], nums[1]) if side == "lower" else (nums[-1], nums[-2])
    integer = all(isinstance(v, int) for v in nums)
    nxt: Any = edge * (edge / inner) if scale == "log" else edge + (edge - inner)
    if integer:
        nxt = int(round(nxt))
        if nxt == edge:
            nxt = edge + (1 if side == "upper" else -1)
    else:
        nxt = float(f"{nxt:.6g}")  # 0.05 * 5 = 0.25, not 0.25000000000000006 (a clean folder name)
    low, high = bounds
    limit = low if side == "lower" else high
    if limit is not None and (nxt < limit if side == "lower" else nxt > limit):
        if edge == limit:
            return None, f"bound {arg_value(limit)}"
        nxt = limit
    return nxt, ""


def edges(tune: Tune, winner: Mapping[str, Any], used: int) -> list[Edge]:
    """The numeric axes on which ``winner`` (key -> value) sits at an edge of the values ``tune`` has tried (its
    grid and extension points, those whose runs failed included), each with its next value or what stops it.
    ``used``: the extensions this method already ran (``tune.extend`` is its budget)."""
    points = tune.points()
    declared_scale, declared_bounds = dict(tune.scale), dict(tune.bounds)
    out = []
    for key, grid_values in tune.grid:
        tried = [values[key] for _, _, values in points]
        if not all(is_number(v) for v in tried) or len(set(tried)) < 2:
            continue
        value = winner[key]
        side = "lower" if value == min(tried) else "upper" if value == max(tried) else None
        if side is None:
            continue
        scale = axis_scale(key, list(grid_values), declared_scale)
        nxt, stop = outward(tried, side, scale, axis_bounds(key, list(grid_values), declared_bounds))
        if nxt is not None and used >= tune.extend:
            nxt, stop = None, f"budget ({tune.extend} extension{'s' if tune.extend != 1 else ''})"
        out.append(Edge(key, side, value, nxt, stop))
    return out


def extended(tune: Tune, winner: Mapping[str, Any], grown: Sequence[Edge]) -> Tune:
    """``tune`` with one new point per edge in ``grown``: its next value, the winner's values elsewhere."""
    keys = [k for k, _ in tune.grid]
    new = tuple(tuple(e.next_value if k == e.key else winner[k] for k in keys) for e in grown)
    return dataclasses.replace(tune, extra=tune.extra + new)


def with_tunes(experiment: Experiment, tunes: Mapping[str, Tune]) -> Experiment:
    """A copy of ``experiment`` whose method values named in ``tunes`` carry those tunes."""
    axes = dict(experiment.axes)
    axes["method"] = [
        dataclasses.replace(p, tune=tunes[p.label]) if p.label in tunes else p for p in axes.get("method", [])
    ]
    return dataclasses.replace(experiment, axes=axes)


def method_tunes(experiment: Experiment) -> dict[str, Tune]:
    return {p.label: p.tune for p in experiment.axes.get("method", []) if isinstance(p, AxisValue) and p.tune}


def extend_grids(
    experiment: Experiment,
    extra: Sequence[str],
    tuning: list[TuneRun],
    choices: dict[tuple[str, ...], Choice],
    run: Callable[[Experiment, list[RunSpec]], list[Outcome]],
    choose: Callable[[Experiment, list[TuneRun], Collection[str]], dict[tuple[str, ...], Choice]],
    out: TextIO,
) -> tuple[list[TuneRun], list[Outcome], dict[tuple[str, ...], Choice]]:
    """Grow every method's grid past its winner's edges and choose again, until no winner has an edge left to
    extend (module docstring). ``run`` trains the new tuning runs, ``choose`` is ``runner.choose``. Returns every
    tuning run, the new runs' outcomes and the final choices, whose ``edges`` name the edges left and why."""
    tunes = method_tunes(experiment)
    used = dict.fromkeys(tunes, 0)
    lost: set[str] = set()
    outcomes: list[Outcome] = []
    while True:
        grow: dict[str, Tune] = {}
        for choice in choices.values():
            method = choice.axes.get("method")
            if choice.point is None or method not in tunes:
                continue
            tune = tunes[method]
            winner = next(values for label, _, values in tune.points() if label == choice.point)
            found = edges(tune, winner, used[method])
            choice.edges = [e.flag() for e in found if e.next_value is None]
            new = [e for e in found if e.next_value is not None]
            if new:
                grow[method] = extended(grow.get(method, tune), winner, new)
                for e in new:
                    leaf = e.key.rsplit(".", 1)[-1]
                    print(f"tune: method={method}: {choice.point} sits at the {e.side} edge of {leaf}; trying "
                          f"{leaf}={arg_value(e.next_value)} (extension {used[method] + 1} of {tune.extend})",
                          file=out)  # fmt: skip
        if not grow:
            return tuning, outcomes, choices
        for method, tune in grow.items():
            used[method] += 1
            tunes[method] = tune
        experiment = with_tunes(experiment, tunes)
        known = {t.run.run_dir for t in tuning}
        tuning = experiment.tuning_runs(extra)
        fresh = [t.run for t in tuning if t.run.run_dir not in known]
        out.flush()
        done = run(experiment, fresh)
        outcomes += done
        if any(o.status == "interrupted" for o in done):
            return tuning, outcomes, choices
        lost |= {str(o.run.run_dir) for o in done if o.status == "failed"}
        choices = choose(experiment, tuning, lost)
