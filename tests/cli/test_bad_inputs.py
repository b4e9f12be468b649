"""Issue 29: every mistake gets one clear line (exit code 2) and a run dir is never a trap.

One case per class of the issue: silent out-of-range values, duplicate YAML keys and axis values, generic parser
messages, data that cannot train, environment errors (run dir, disk, W&B), resume with another config, run dirs
left by interrupted runs, the runner's ``[done]``, ``compare``'s output folder; and a finished run's files stay
byte-identical after every refused command. ``train.py`` runs in this process (``fl_lightning.cli.main``).
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from fl_lightning.experiment.__main__ import main as experiment_main
from tests.helpers.training import train_here

ROOT = Path(__file__).resolve().parents[2]
QUICK = str(ROOT / "configs/quickstart.yaml")
FAST = ["--trainer.enable_progress_bar", "false", "--model.algorithm.init_args.head_epochs", "1"]


def train(run_dir: Path | None, *args: str, config: str = QUICK, steps: str = "2") -> int:
    where = ["--run_dir", str(run_dir)] if run_dir is not None else []
    return train_here(["--config", config, "--trainer.max_steps", steps, *FAST, *where, *args])


#: what a run says about itself when its first round starts (a failure during training follows them)
RUN_INFO = ("executor: ", "run axis: ")


def one_error(capsys, trained: bool = False) -> str:
    """The single line the command printed on stderr (it must be exactly one, starting with ``error:``); with
    ``trained``, after the lines the run printed when it started training."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    if trained:
        assert lines and lines[0].startswith("executor: "), lines  # the run said which path it trains on
        lines = [ln for ln in lines if not ln.startswith(RUN_INFO)]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    return lines[0]


def refused(capsys, code: int, *names: str, trained: bool = False) -> str:
    line = one_error(capsys, trained)
    assert code == 2, line
    for name in names:
        assert name in line, (name, line)
    return line


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-round quickstart run (checkpoint every round)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert train(run_dir, "--checkpoint_every", "1") == 0
    assert (run_dir / "summary.json").is_file()
    return run_dir


def yaml_file(tmp_path: Path, text: str, name: str = "bad.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- values that used to train silently -----------------------------------------------------------------------

RANGES = {
    "negative head epochs": (["--model.algorithm.init_args.head_epochs", "-3"], "model.algorithm.head_epochs", "-3",
                             "≥ 1"),  # fmt: skip
    "zero evaluation interval": (["--trainer.val_check_interval", "0"], "trainer.val_check_interval", "0", "≥ 1"),
    "zero checkpoint interval": (["--checkpoint_every", "0"], "checkpoint_every", "0", "≥ 1"),
    "zero rounds": (["--trainer.max_steps", "0"], "trainer.max_steps", "0", "≥ 1"),
    "negative server lr": (["--model.server_lr", "-1"], "model.server_lr", "-1", "> 0"),
    "unknown W&B mode": (["--wandb.mode", "onlin"], "wandb.mode", "'onlin'", "offline"),
    "empty W&B tag": (["--wandb.tags", '[""]'], "wandb.tags", "''", "1 to 64 characters"),
    "W&B project with a slash": (["--wandb.project", "me/proj"], "wandb.project", "'me/proj'", "without /"),
    # held out in issue 45's second round: an infinite rate trained to NaN (every client dropped, exit 0), a
    # negative seed was numpy's line without the key, zero devices Lightning's line without the key or the fix
    "infinite learning rate": (["--model.lr", "1e999"], "model.lr", "inf", "finite"),
    "negative seed": (["--seed_everything", "-1"], "seed_everything", "-1", "[0, 2**32)"),
    "zero devices": (["--trainer.devices", "0"], "trainer.devices", "0", "-1 (all) or auto"),
}


@pytest.mark.parametrize("case", list(RANGES))
def test_an_out_of_range_value_is_refused_naming_key_value_range_and_fix(case, tmp_path, capsys):
    args, key, value, allowed = RANGES[case]
    line = refused(capsys, train(tmp_path / "run", *args), key, value, allowed, "fix:", f"--{key}")
    assert not (tmp_path / "run" / "metrics.csv").exists(), line  # refused before anything ran


def test_a_value_from_a_config_file_is_located_by_file_and_line(tmp_path, capsys):
    bad = yaml_file(tmp_path, "model:\n  algorithm:\n    init_args:\n      head_epochs: -3\n")
    code = train(tmp_path / "run", "--config", bad)
    refused(capsys, code, "model.algorithm.head_epochs", "-3", f"{bad} line 4", "fix:")
    null = yaml_file(tmp_path, "model:\n  lr:\n", "null.yaml")
    refused(capsys, train(tmp_path / "run", "--config", null), "model.lr", "null", f"{null} line 2", "fix:")


def test_a_key_given_twice_in_a_config_is_refused_with_both_lines(tmp_path, capsys):
    bad = yaml_file(tmp_path, "model:\n  lr: 0.1\n  momentum: 0.0\n  lr: 0.2\n")
    refused(capsys, train(tmp_path / "run", "--config", bad), bad, "line 4", "'lr'", "line 2", "twice")


# ---- generic parser messages, rewritten --------------------------------------------------------------------------

PARSER = {
    "not a number": (["--model.lr", "abc"], ["model.lr", "'abc'", "number", "fix:"]),
    "not an integer": (["--model.batch_size", "2.5"], ["model.batch_size", "'2.5'", "integer", "fix:"]),
    "a list for a number": (["--model.lr", "[0.01,0.01]"], ["model.lr", "0.01, 0.01", "number"]),
    "seed not an int": (["--seed_everything", "abc"], ["seed_everything", "'abc'", "integer", "true or false"]),
    "nested class argument": (["--data.init_args.num_clients", "x"], ["data.num_clients", "'x'", "integer"]),
    "unknown nested key": (["--data.init_args.num_users", "5"], ["data.num_users", "unknown key", "fix:"]),
}


@pytest.mark.parametrize("case", list(PARSER))
def test_a_parser_error_is_one_line_with_key_value_and_expected_type(case, tmp_path, capsys):
    args, names = PARSER[case]
    line = refused(capsys, train(tmp_path / "run", *args), *names)
    assert "Parser key" not in line and "<class" not in line


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- 1\n"])
def test_a_config_file_that_is_not_a_mapping_is_named(text, tmp_path, capsys):
    bad = yaml_file(tmp_path, text)
    refused(capsys, train(tmp_path / "run", "--config", bad), f"config file {bad}", "mapping", "fix:")


def test_an_unknown_key_in_a_config_file_is_named(tmp_path, capsys):
    bad = yaml_file(tmp_path, "model:\n  learning_rate: 0.1\n")
    refused(capsys, train(tmp_path / "run", "--config", bad), "model.learning_rate", "unknown key", "fix:")
    wrong = yaml_file(tmp_path, "model:\n  momentum: 0.1\n  lr: fast\n", "wrong.yaml")
    refused(capsys, train(tmp_path / "run", "--config", wrong), f"model.lr ({wrong} line 3)", "'fast'", "number")


# ---- experiment files ----------------------------------------------------------------------------------------------


def experiment_file(tmp_path: Path, body: str) -> str:
    return yaml_file(tmp_path, f"name: dup\nconfigs: [{QUICK}]\nset: {{trainer.max_steps: 1}}\n{body}", "exp.yaml")


def test_a_method_label_given_twice_is_refused(tmp_path, capsys):
    path = experiment_file(tmp_path, "axes:\n  method:\n    a: {model.lr: 0.1}\n    a: {model.lr: 0.2}\n")
    refused(capsys, experiment_main(["run", path, "--dry-run"]), path, "line 7", "'a'", "twice", "line 6")


def test_an_axis_value_given_twice_is_refused(tmp_path, capsys):
    path = experiment_file(tmp_path, "axes:\n  model.lr: [0.01, 0.01]\n")
    refused(capsys, experiment_main(["run", path, "--dry-run"]), path, "axes.model.lr", "0.01", "twice", "fix:")
    seeds = experiment_file(tmp_path, "axes:\n  seed: [0, 1, 0]\n")
    refused(capsys, experiment_main(["run", seeds, "--dry-run"]), "axes.seed", "seed 0", "twice")
    by = experiment_file(tmp_path, "axes:\n  seed: [0, 1]\n")
    refused(capsys, experiment_main(["run", by, "--dry-run", "--by", "method"]), "--by method", "seed", "fix:")
    with pytest.raises(SystemExit) as exit_:  # argparse's own mistakes: one line too
        experiment_main(["run", by, "--jobz", "2"])
    refused(capsys, exit_.value.code, "--jobz", "--help")


def test_an_experiment_run_with_an_out_of_range_value_is_refused_before_any_run(tmp_path, capsys):
    path = experiment_file(tmp_path, "axes:\n  model.lr: [0.01, -0.5]\n")
    code = experiment_main(["run", path, "--runs-dir", str(tmp_path / "runs")])
    refused(capsys, code, "lr=-0.5", "model.lr", "-0.5", "> 0")
    assert not (tmp_path / "runs" / "dup" / "lr=0.01").exists()  # nothing ran


# ---- data that cannot train ---------------------------------------------------------------------------------------


@pytest.fixture
def corrupt_digits(monkeypatch):
    """DigitsDataModule whose built data gets a NaN feature (client 3, row 2) or a label 10 (client 5, row 0)."""
    from datamodules.digits import DigitsDataModule

    build = DigitsDataModule.build
    what: dict[str, str] = {}

    def corrupted(self):
        fed = build(self)
        lo3, lo5 = int(fed.train.ptr[3]), int(fed.train.ptr[5])
        if what.get("kind") == "nan":
            fed.train.x[lo3 + 2, 0] = float("nan")
        else:
            fed.train.y[lo5] = 10
        return fed

    monkeypatch.setattr(DigitsDataModule, "build", corrupted)
    return what


def test_non_finite_features_are_refused_at_setup_naming_client_and_row(corrupt_digits, tmp_path, capsys):
    corrupt_digits["kind"] = "nan"
    refused(capsys, train(tmp_path / "run"), "non-finite", "client 3 row 2", "1 train rows", "fix:")
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_labels_outside_the_classes_are_refused_at_setup(corrupt_digits, tmp_path, capsys):
    corrupt_digits["kind"] = "label"
    refused(capsys, train(tmp_path / "run"), "labels outside [0, 10)", "client 5 row 0", "fix:")


def test_an_empty_test_split_is_refused_unless_evaluation_is_off(tmp_path, capsys):
    args = ["--data.init_args.test_fraction", "0"]
    refused(capsys, train(tmp_path / "run", *args), "test split is empty", "test_fraction=0", "limit_val_batches 0")
    assert train(tmp_path / "off", *args, "--trainer.limit_val_batches", "0", steps="1") == 0  # asked for: works
    capsys.readouterr()


def test_a_run_without_evaluation_reports_no_accuracy_rather_than_nan_or_zero(tmp_path, capsys):
    """``--trainer.limit_val_batches 0``: summary.json is strict JSON without final/last10/best (it held a bare
    ``NaN`` and a fake ``last10 0.0``), says no evaluation ran, and keeps the figures that need none."""
    assert train(tmp_path / "run", "--trainer.limit_val_batches", "0") == 0
    assert "nan" not in capsys.readouterr().out.lower()

    def strict(token: str) -> float:
        raise AssertionError(f"summary.json holds {token}")

    summary = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=strict)
    assert not {"final", "last10", "best"} & set(summary)
    assert summary["evaluations"] == 0 and summary["rounds"] == 2 and summary["upload_bytes"] > 0


# ---- the environment ----------------------------------------------------------------------------------------------


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("x")
    refused(capsys, train(tmp_path / "taken"), "--run_dir", "is a file", "fix:")
    refused(capsys, train(tmp_path / "taken" / "sub"), "is inside", "is a file")


def test_a_read_only_run_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """The tests run as root, which writes anywhere: the read-only file system is the OSError it would raise."""
    real = Path.write_bytes

    def read_only(self, data):
        if self.name == ".write-test":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    refused(capsys, train(tmp_path / "run"), "--run_dir", "cannot be written", "Read-only file system", "fix:")


def test_wandb_online_without_credentials_is_one_line_and_wins_over_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # used to win silently over --wandb.mode online
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    code = train(tmp_path / "run", "--wandb.mode", "online")
    refused(capsys, code, "--wandb.mode online", "no W&B credentials", "wandb login", "--wandb.mode offline")
    from fl_lightning.cli import _wandb_mode

    assert _wandb_mode("auto") == "disabled" and _wandb_mode("offline") == "offline"


def test_wandb_refusing_to_start_is_one_line_naming_the_option():
    import wandb

    from fl_lightning.cli import wandb_problem

    with pytest.raises(ValueError) as pydantic:
        wandb.Settings(mode="offline", run_tags=("",))
    assert wandb_problem(pydantic.value) == ("wandb.tags: W&B refuses it: Tag at index 0 is empty. Tags must be "
                                             "between 1 and 64 characters; fix: change --wandb.tags")  # fmt: skip
    usage = wandb.errors.UsageError("Invalid project name 'a/b': cannot contain characters '/'")
    assert wandb_problem(usage).startswith("wandb.project: W&B refuses it: Invalid project name 'a/b'")


def test_a_disk_too_full_for_the_next_checkpoint_stops_and_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    import fl_lightning.callbacks as callbacks

    real = shutil.disk_usage
    run_dir = tmp_path / "run"

    def fake(path):  # round 1 and last.ckpt fit; once they are written, the disk is full
        usage = real(path)
        return usage._replace(free=10) if (run_dir / "checkpoints" / "round00001.ckpt").exists() else usage

    monkeypatch.setattr(callbacks.shutil, "disk_usage", fake)
    code = train(run_dir, "--checkpoint_every", "1")
    line = refused(capsys, code, "disk full", "round00002.ckpt", "bytes", "10 are free", "--ckpt_path last",
                   trained=True)
    previous = run_dir / "checkpoints" / "round00001.ckpt"
    assert f"previous checkpoint {run_dir / 'checkpoints'}" in line
    assert not (run_dir / "checkpoints" / "round00002.ckpt").exists()
    for name in ("round00001.ckpt", "last.ckpt"):
        assert torch.load(previous.parent / name, map_location="cpu", weights_only=True)["global_step"] == 1
    needed = int(line.split("needs about ")[1].split(" bytes")[0].replace(",", ""))
    assert needed >= previous.stat().st_size  # the estimate covers a checkpoint of the same run


def test_compare_with_wandb_offline_is_one_line(tmp_path, capsys, monkeypatch):
    import requests
    import wandb

    def offline(*args, **kwargs):
        raise requests.exceptions.ConnectionError("Max retries exceeded with url: /graphql")

    monkeypatch.setattr(wandb, "Api", offline)
    code = experiment_main(["compare", "--wandb", "me/proj", "--group", "g", "--out", str(tmp_path / "c")])
    refused(capsys, code, "--wandb me/proj", "ConnectionError", "wandb login", "fix:")


# ---- resume means the same run --------------------------------------------------------------------------------


def test_a_resume_with_a_changed_learning_rate_is_refused_and_changes_nothing(finished, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    (run_dir / "summary.json").unlink()  # an unfinished run: resumable
    before = snapshot(run_dir)
    code = train(run_dir, "--checkpoint_every", "1", "--ckpt_path", "last", "--model.lr", "0.05", steps="4")
    refused(capsys, code, "--ckpt_path", "model.lr 0.01 -> 0.05", "config.yaml", "fix:")
    assert snapshot(run_dir) == before
    # what cannot change results may change: a longer run, other logging; config.yaml is not rewritten
    code = train(run_dir, "--ckpt_path", "last", "--checkpoint_every", "3", "--trainer.log_every_n_steps", "2",
                 steps="3")  # fmt: skip
    assert code == 0, capsys.readouterr().err[-2000:]
    assert (run_dir / "config.yaml").read_bytes() == before["config.yaml"]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 3


# ---- run dirs are never a trap ------------------------------------------------------------------------------------


def test_the_hint_names_the_working_overwrite_flag(finished, capsys):
    line = refused(capsys, train(finished), str(finished), "--ckpt_path last", "--overwrite true")
    assert "--overwrite," not in line


@pytest.mark.parametrize("resume", [False, True])
def test_a_dir_left_before_the_first_checkpoint_is_reused(resume, tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "wandb").mkdir(parents=True)
    (run_dir / "metrics.csv").write_text("step,train/loss\n0,1.0\n")
    (run_dir / "wandb_id").write_text("abcd1234\n")
    (run_dir / "config.yaml").write_text("model:\n  lr: 0.5\n")  # whatever the stopped run was
    code = train(run_dir, *(["--ckpt_path", "last"] if resume else []), steps="1")
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "starting it afresh" in capsys.readouterr().out
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 1


def test_a_run_killed_after_its_last_round_finishes_its_summary_on_resume(finished, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    want = json.loads((run_dir / "summary.json").read_text())
    for name in ("summary.json", "clients.csv", "history.json"):  # killed before the end of _fit
        (run_dir / name).unlink()
    assert train(run_dir, "--checkpoint_every", "1", "--ckpt_path", "last") == 0
    got = json.loads((run_dir / "summary.json").read_text())
    assert {k: v for k, v in got.items() if k != "wall_s"} == {k: v for k, v in want.items() if k != "wall_s"}
    assert (run_dir / "clients.csv").read_bytes() == (finished / "clients.csv").read_bytes()


def test_the_runner_prints_done_only_with_a_summary_and_resumes_such_a_run(tmp_path, monkeypatch):
    import io

    from fl_lightning.experiment import runner
    from fl_lightning.experiment.spec import load_experiment

    path = experiment_file(tmp_path, "axes:\n  seed: [0]\n")
    experiment = load_experiment(path, runs_dir=tmp_path / "runs")
    (run,) = experiment.runs()
    monkeypatch.setattr(runner, "run_in_process", lambda args, log: ("done", ""))  # returns, writes no summary
    stream = io.StringIO()
    (outcome,) = runner.execute(experiment, [run], {str(run.run_dir): 1}, stream=stream)
    assert outcome.status == "failed" and "[done]" not in stream.getvalue() and "summary.json" in outcome.error
    (run.run_dir / "checkpoints").mkdir()
    (run.run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert runner.run_state(run, 1) == "resume"  # the next command continues it


# ---- compare -----------------------------------------------------------------------------------------------------


def test_compare_refuses_an_unknown_metric_and_never_overwrites_another_comparison(finished, tmp_path, capsys,
                                                                                   monkeypatch):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    refused(capsys, experiment_main(["compare", str(finished), "--metric", "last100"]), "--metric last100",
            "last10", "fix:")  # fmt: skip
    refused(capsys, experiment_main(["compare", str(finished), "--by", "dataset"]), "--by dataset", "method")
    assert experiment_main(["compare", str(finished)]) == 0
    (made,) = (tmp_path / "results" / "compare").iterdir()
    assert made.name.startswith("run-") and (made / "results.json").is_file()  # named for its input
    other = tmp_path / "other"
    shutil.copytree(finished, other)
    capsys.readouterr()
    before = snapshot(made)
    refused(capsys, experiment_main(["compare", str(other), "--out", str(made)]), str(made), "holds a comparison",
            "--overwrite")  # fmt: skip
    assert snapshot(made) == before
    assert experiment_main(["compare", str(finished), "--out", str(made)]) == 0  # the same comparison again
    assert experiment_main(["compare", str(other), "--out", str(made), "--overwrite"]) == 0


# ---- a finished run survives every refused command ---------------------------------------------------------------


def test_a_finished_run_is_byte_identical_after_every_refused_command(finished, tmp_path, capsys, monkeypatch):
    before = snapshot(finished)
    dup = yaml_file(tmp_path, "model:\n  lr: 0.1\n  lr: 0.2\n")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    commands = [
        [],  # a second run into the dir
        ["--ckpt_path", "last", "--model.lr", "0.05"],  # resume with another lr
        ["--ckpt_path", "last", "--model.algorithm.init_args.head_epochs", "-3"],
        ["--model.lr", "abc"],
        ["--config", dup],
        ["--wandb.mode", "online"],
        ["--trainer.val_check_interval", "0"],
        ["--data.init_args.test_fraction", "0", "--overwrite", "false"],
    ]
    for args in commands:
        code = train(finished, "--checkpoint_every", "1", *args)
        refused(capsys, code)
        assert snapshot(finished) == before, args


# ---- a refused command creates and changes nothing, anywhere (issue 45) -------------------------------------------

DP = str(ROOT / "configs/dp/privacy.yaml")
#: refusals found only after the data, the checkpoint, the trainer or DP's accountant are built: each was refused
#: after W&B had started a run (and written into the run dir) before issue 45. name -> (subcommand, args, in the line)
LATE_REFUSALS = {
    "data cannot be split": ((), ["--data.init_args.num_clients", "200",
                                  "--data.init_args.partition.init_args.classes_per_client", "10"], "too few to fill"),
    "GPU asked on a CPU": ((), ["--trainer.accelerator", "gpu"], "trainer.accelerator gpu"),
    "DP needs uniform aggregation": ((), ["--config", DP, "--model.aggregation", "num_samples"], "uniform"),
    "unreachable target_epsilon": ((), ["--config", DP, "--model.privacy.target_epsilon", "1e-6"], "cannot be met"),
    "checkpoint of another population": ((), ["--ckpt_path", "FINISHED/checkpoints/last.ckpt",
                                              "--data.init_args.num_clients", "10"], "20 clients"),
    "validate in the finished run's dir, other population": (
        ("validate",), ["--run_dir", "FINISHED", "--ckpt_path", "last", "--data.init_args.num_clients", "10"],
        "20 clients"),
    "test in the finished run's dir, data cannot be split": (
        ("test",), ["--run_dir", "FINISHED", "--ckpt_path", "last", "--data.init_args.num_clients", "200",
                    "--data.init_args.partition.init_args.classes_per_client", "10"], "too few to fill"),
    "overwrite the finished run, GPU asked on a CPU": (
        (), ["--run_dir", "FINISHED", "--overwrite", "true", "--trainer.accelerator", "gpu"], "accelerator"),
}  # fmt: skip


def tree(folder: Path) -> dict[str, str]:
    """Every file (its bytes' hash) and folder under ``folder``."""
    import hashlib

    out = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
    return out


@pytest.mark.parametrize("case", list(LATE_REFUSALS))
def test_a_refusal_leaves_every_file_tree_byte_identical(case, finished, tmp_path, capsys, monkeypatch):
    """With W&B offline (what a user without an account gets): no W&B run, no run dir, no ``wandb_id``, no
    ``config.yaml``, nothing cleared by ``--overwrite``; in the working folder, in a new run dir and in a finished
    run's dir."""
    if case.startswith(("GPU", "overwrite")) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    stage, args, expected = LATE_REFUSALS[case]
    args = [a.replace("FINISHED", str(finished)) for a in args]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    before = (tree(tmp_path), tree(finished.parent))
    where = [] if "--run_dir" in args else ["--run_dir", str(tmp_path / "new")]
    code = train_here([*stage, "--config", QUICK, "--trainer.max_steps", "2", *FAST, *where, *args])
    refused(capsys, code, expected)
    assert (tree(tmp_path), tree(finished.parent)) == before


def test_fast_dev_run_writes_nothing_and_a_real_run_follows_in_its_dir(tmp_path, tmp_path_factory, capsys,
                                                                       monkeypatch):
    """``--trainer.fast_dev_run true`` prints "nothing written" and writes nothing (no ``checkpoints/last.ckpt`` that
    the next real run would be refused over, no W&B run); the real run then starts from round 0 in that dir."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train(tmp_path / "run", "--trainer.fast_dev_run", "true") == 0
    assert "fast_dev_run: nothing written" in capsys.readouterr().out
    assert tree(tmp_path) == {}
    callback = "{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {monitor: val/acc_mean}}"
    best = yaml_file(tmp_path_factory.mktemp("config"), f"trainer:\n  callbacks:\n    - {callback}\n", "best.yaml")
    assert train(tmp_path / "run", "--config", best, "--trainer.fast_dev_run", "true") == 0  # the user's own too
    assert "fast_dev_run: nothing written" in capsys.readouterr().out and tree(tmp_path) == {}
    assert train(tmp_path / "run", "--wandb.mode", "disabled") == 0
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["round"] for h in history] == [0, 1] and (tmp_path / "run" / "config.yaml").is_file()


# ---- one W&B run per run, no round logged twice -----------------------------------------------------------------


@pytest.mark.slow  # W&B's service starts twice
def test_a_resumed_offline_wandb_run_logs_no_round_twice(tmp_path, monkeypatch, capsys):
    from fl_lightning.wandb_files import offline_runs

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = ["--checkpoint_every", "2", "--wandb.mode", "offline"]
    assert train(run_dir, *args, steps="4") == 0
    (first,) = offline_runs(run_dir, wait_s=60)
    # killed after round 4 was logged, before its checkpoint: the resume recomputes rounds 3 and 4 (steps 2, 3)
    for name in ("summary.json", "checkpoints/round00004.ckpt", "checkpoints/last.ckpt"):
        (run_dir / name).unlink()
    assert train(run_dir, *args, "--ckpt_path", "last", steps="4") == 0
    capsys.readouterr()
    runs = offline_runs(run_dir, wait_s=60)
    assert len(runs) == 2 and {r.id for r in runs} == {first.id}  # one W&B run (two folders, synced in order)
    steps = [row["trainer/global_step"] for r in runs for row in r.history if "val/acc_mean" in row]
    assert sorted(steps) == [0, 1, 2, 3]  # every round once
    assert runs[-1].summary["summary/rounds"] == 4
