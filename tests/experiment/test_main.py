"""``python -m fl_lightning.experiment`` (``fl_lightning/experiment/__main__.py``): a bad experiment file stops before
any run with one line naming the file, the key and the fix (the runs themselves: ``test_runner.py``)."""

from __future__ import annotations

import pytest

from fl_lightning.experiment.__main__ import main
from tests.helpers.experiment_files import tiny, write_experiment

BAD = {
    "unknown key": ({"nme": "x"}, "nme: unknown key"),
    "missing config": ({"configs": ["configs/nope.yaml"]}, "configs[0]: config file configs/nope.yaml does not exist"),
    "seed that is no integer": ({"axes": {"seed": [0, "one"]}}, "axes.seed: 'one' is not an integer seed"),
    "unknown override key": ({"set": {"model.learning_rate": 0.1}}, "learning_rate"),
    "override of the wrong type": ({"set": {"model.lr": "fast"}}, "model.lr"),
    "unknown wandb key": ({"wandb": {"group": "g"}}, "wandb.group: unknown key"),
    "bad axis value": ({"axes": {"method": {"fedavg": 3}}}, "axes.method.fedavg: expected a config path"),
    "300-character name": ({"name": "x" * 300}, "name: at most 100 characters"),  # was a chained traceback
    "report metric typo": ({"report": {"metrics": ["last10", "final_worst"]}},
                           "report.metrics: 'final_worst' is not a summary.json figure; did you mean final_worst10?"),
    "report curve without a key": ({"report": {"curve": "acc_mean"}}, "report.curve: expected a metrics.csv column"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_experiment_file_stops_before_any_run(case, tmp_path, capsys):
    change, expected = BAD[case]
    data = tiny()
    data.update(change)
    path = write_experiment(tmp_path, data)
    assert main(["run", str(path), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and expected in lines[0], err
    assert not (tmp_path / "runs").exists()
