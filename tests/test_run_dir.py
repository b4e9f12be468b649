"""``fl_lightning/run_dir.py``: what a command may do with the run dir it names (``plan_run_dir``), the resume's
identity check (``config_differences``) and the default dir (the commands themselves: tests/cli/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fl_lightning.errors import ConfigError
from fl_lightning.run_dir import RunFinished, config_differences, default_run_dir, plan_run_dir


def test_config_differences_name_what_changes_results_and_nothing_else():
    saved = {"seed_everything": 0, "trainer": {"max_steps": 10, "accelerator": "cpu"}, "checkpoint_every": 5,
             "model": {"lr": 0.01, "algorithm": {"class_path": "A", "init_args": {"head_epochs": 10}}},
             "wandb": {"mode": "offline"}}  # fmt: skip
    same = json.loads(json.dumps(saved))
    same["trainer"]["max_steps"], same["checkpoint_every"], same["wandb"]["mode"] = 50, 1, "disabled"
    same["model"]["new_option"] = True  # an option the code gained since the run started: not compared
    assert config_differences(saved, same) == []
    other = json.loads(json.dumps(saved))
    other["model"]["algorithm"]["init_args"]["head_epochs"], other["seed_everything"] = 3, 1
    assert config_differences(saved, other) == ["seed_everything 0 -> 1", "model.algorithm.head_epochs 10 -> 3"]


def test_plan_run_dir_for_each_state_of_the_dir(tmp_path: Path) -> None:
    """An empty dir starts; a finished one refuses a new start and is a no-op to resume; an unfinished one resumes
    with its checkpoint or refuses a new start; one left before its first checkpoint is cleared; ``--overwrite``
    clears whatever is there (``--ckpt_path last`` then starts from round 0)."""
    empty, finished, unfinished, stale = (tmp_path / n for n in ("empty", "finished", "unfinished", "stale"))
    for d in (empty, finished, unfinished, stale):
        d.mkdir()
    (finished / "summary.json").write_text(json.dumps({"rounds": 5}))
    (unfinished / "checkpoints").mkdir()
    (unfinished / "checkpoints" / "last.ckpt").write_bytes(b"")
    (stale / "config.yaml").write_text("seed_everything: 0\n")
    assert plan_run_dir(empty, None, False, 5) == (None, None)
    with pytest.raises(ConfigError, match="holds a finished run"):
        plan_run_dir(finished, None, False, 5)
    with pytest.raises(RunFinished):
        plan_run_dir(finished, "last", False, 5)
    assert plan_run_dir(finished, "last", False, 8) == ("last", None)  # more rounds asked: it continues
    assert plan_run_dir(unfinished, "last", False, 5) == ("last", None)
    with pytest.raises(ConfigError, match="holds an unfinished run"):
        plan_run_dir(unfinished, None, False, 5)
    assert plan_run_dir(stale, "last", False, 5) == (None, "stale")
    assert plan_run_dir(finished, "last", True, 5) == (None, "overwrite")
    assert plan_run_dir(empty, None, True, 5) == (None, None)


def test_the_default_run_dir_is_named_after_the_config_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    assert default_run_dir({"config": ["configs/digits/base.yaml", "configs/digits/fedrep.yaml"]}) == Path(
        "runs/base_fedrep"
    )
    assert default_run_dir({}) == Path("runs/run")
