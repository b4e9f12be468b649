"""``python -m experiments digits`` (``experiments/digits.py``): issue 2's checks on mean accuracies chosen here, and
the methods it shows are methods of the Table 1 experiment file it runs."""

from __future__ import annotations

from experiments import digits
from fl_lightning.experiment.spec import load_experiment

PASSING = {"FedAvg": 0.50, "FedAvg+FT": 0.80, "FedRep": 0.86, "FedPer": 0.87, "LG-FedAvg": 0.70, "Local Only": 0.75}


def test_the_three_checks_pass_on_the_papers_pattern():
    checks = digits.pattern_checks(PASSING)
    assert [ok for _, ok in checks] == [True, True, True]
    assert checks[0][0] == "FedRep is best or within 2 points of the best (86.00 vs 87.00)"
    assert checks[1][0] == "FedRep is ≥ 15 points above FedAvg's global model (+36.0)"
    assert checks[2][0] == "FedAvg+FT recovers most of that gap (83%)"  # (0.80 − 0.50) / 0.36


def test_each_check_fails_on_its_own():
    assert [ok for _, ok in digits.pattern_checks({**PASSING, "FedPer": 0.90})] == [False, True, True]
    assert [ok for _, ok in digits.pattern_checks({**PASSING, "FedAvg": 0.75, "FedAvg+FT": 0.85})] == [True, False,
                                                                                                     True]  # fmt: skip
    assert [ok for _, ok in digits.pattern_checks({**PASSING, "FedAvg+FT": 0.60})] == [True, True, False]
    no_gap = digits.pattern_checks({**PASSING, "FedAvg": 0.90})  # FedAvg above FedRep: nothing to recover
    assert [ok for _, ok in no_gap] == [False, False, False] and "(nan%)" in no_gap[2][0]


def test_the_shown_methods_are_the_experiment_files():
    methods = {p.label for p in load_experiment(digits.EXPERIMENT).axes["method"]}
    assert set(digits.LABELS) <= methods and len(digits.LABELS) == 6
