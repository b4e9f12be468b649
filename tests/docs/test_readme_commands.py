"""The README's first commands, run in order as a new user would (issue 45), at reduced rounds: ``make train``'s job,
then every ``train.py`` line of "Running experiments" and of "fit, validate, test", in a fresh folder that sees the
repository's ``configs/`` (and an ``X.yaml``, the placeholder of "fit, validate, test", copied from the quickstart,
so that its run dir is ``runs/X``). Rounds are cut to 2 (the resume's 150 to 3) with a checkpoint every round, so the
default run keeps round00001 and round00002, and the ``test`` line's ``round00090`` (the next-to-last checkpoint
a default 100-round run keeps) becomes round00001. Long commands named elsewhere in the README (``make reproduce``,
``make bench``, the experiment files) are left out: their own tests run them at their smallest size."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers.training import train_here

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("## Running experiments", "### fit, validate, test")


def readme_commands() -> list[list[str]]:
    """The ``train.py`` command lines of the README's sections :data:`SECTIONS`, in order, as argument lists
    (continuation lines joined, comments dropped)."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for title in SECTIONS:
        body = text[text.index(title) :]
        block = re.search(r"```bash\n(.*?)```", body, flags=re.S).group(1)
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "train.py" in " ".join(words[:2]):
                args = words[words.index(next(w for w in words if w.endswith("train.py"))) + 1 :]
                commands.append(args)
    return commands


def reduced(args: list[str]) -> list[str]:
    if "--help" in args or "--print_config" in args:
        return args
    args = [a.replace("round00090.ckpt", "round00001.ckpt") for a in args]
    if "--trainer.max_steps" in args:  # the resume: 50 more rounds of 100 -> 1 more of 2
        i = args.index("--trainer.max_steps")
        args = [*args[: i + 1], "3", *args[i + 2 :]]
    elif args[:1] not in (["validate"], ["test"]):
        args = [*args, "--trainer.max_steps", "2"]
    fast = ["--checkpoint_every", "1", "--trainer.enable_progress_bar", "false", "--wandb.mode", "disabled"]
    return [*args, *fast] if args[:1] not in (["validate"], ["test"]) else [*args, *fast[2:]]


def test_the_readme_lists_the_commands_this_test_runs():
    commands = readme_commands()
    assert len(commands) >= 8 and ["--help"] in commands
    assert any(c[:1] == ["test"] and "runs/quickstart/checkpoints/round00090.ckpt" in c for c in commands)


@pytest.mark.slow
def test_the_readme_commands_run_in_order_at_reduced_rounds(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "X.yaml").write_text((ROOT / "configs/quickstart.yaml").read_text())
    monkeypatch.setenv("WANDB_MODE", "disabled")
    make_train = ["--config", "configs/quickstart.yaml", "--overwrite", "true"]  # the Makefile's train line
    for args in [make_train, *readme_commands()]:
        try:
            code = train_here(reduced(args))
        except SystemExit as done:  # --print_config and `fit --help` print and exit, as jsonargparse does
            code = done.code or 0
        out = capsys.readouterr()
        assert code == 0, (args, out.err[-1500:])
        assert "Traceback" not in out.err, args
    first = json.loads((tmp_path / "runs/first/summary.json").read_text())
    assert first["rounds"] == 3  # the resume line continued runs/first
    for name in ("lr0.05", "base_fedavg_ft", "X"):
        assert (tmp_path / "runs" / name / "summary.json").is_file(), name
    tested = json.loads((tmp_path / "runs/quickstart/test.json").read_text())
    assert tested["checkpoint"].endswith("round00001.ckpt") and tested["round"] == 0
    assert (tmp_path / "runs/X/validate.json").is_file()
    assert sys.argv  # train_here put sys.argv back
