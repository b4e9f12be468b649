"""``tools/round_files.py``: one sequential FedRep round runs at most 10 files of ``fl_lightning/`` from
``training_step`` to the server step (issue 41), and the trace sees the round's own files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import round_files  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def test_one_fedrep_round_touches_at_most_ten_files():
    before, after = round_files.trace_round()
    # the trace is real: the files a FedRep round cannot run without are in it, with the functions it calls there
    assert "training_step" in before["fl_lightning/engine/module.py"]
    assert "client_update" in before["fl_lightning/algorithms/fedrep.py"]
    assert "sgd" in before["fl_lightning/engine/sequential.py"]
    assert {"collect", "server_step", "upload"} <= before["fl_lightning/engine/aggregation.py"]
    # what runs only after the server step (the next round's learning rates) is kept apart, not counted
    assert "step_schedules" in after.get("fl_lightning/engine/optimizers.py", set())
    assert not set(after) & set(before)
    assert len(before) <= 10, sorted(before)
