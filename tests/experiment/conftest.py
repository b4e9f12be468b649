"""A fixture shared by the runner and batched-run tests: one ``--jobs 2`` grid run (its worker starts a child
process, so one run serves both files' checks instead of one each)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits")


@pytest.fixture(scope="session")
def worker_grid(tmp_path_factory) -> tuple[Path, int, str, str]:
    """FedRep × 2 seeds, 2 rounds on digits, W&B off, run as ``run exp.yaml --jobs 2`` from a fresh folder (the
    default runs dir, ``runs/``): the two runs batch into one job, run by a worker. Returns the folder, the exit
    code, stdout and stderr."""
    folder = tmp_path_factory.mktemp("workers")
    data = {
        "name": "workers",
        "configs": [f"{DIGITS}/base.yaml"],
        "axes": {"method": {"fedrep": f"{DIGITS}/fedrep.yaml"}, "seed": [0, 1]},
        "set": {"trainer.max_steps": 2, "checkpoint_every": 1, "trainer.enable_progress_bar": False},
        "wandb": {"mode": "disabled"},
    }
    path = folder / "exp.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    from fl_lightning.experiment.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(folder)
        patch.setenv("PYTHONPATH", str(ROOT))  # the job's child process imports this checkout, not an installed copy
        code = main(["run", str(path), "--jobs", "2"])
    return folder, code, out.getvalue(), err.getvalue()
