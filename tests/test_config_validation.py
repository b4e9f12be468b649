"""Table-driven: malformed configs and data files stop before training with one line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs/quickstart.yaml")


def yaml_file(tmp_path: Path, text: str, name: str = "bad.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# (extra CLI args or a callable(tmp_path) -> args, substring expected in the error line)
CASES: dict[str, tuple] = {
    "unknown algorithm": (["--model.algorithm", "fl_lightning.algorithms.FedFoo"], "unknown class"),
    "unknown algorithm module": (["--model.algorithm", "nope.FedAvg"], "unknown class"),
    "unknown network": (["--model.network", "fl_lightning.models.ResNet999"], "unknown class"),
    "unknown dataset": (["--data", "datamodules.ImageNet42"], "unknown class"),
    "unknown partition": (["--data.init_args.partition", "datamodules.Zipf"], "unknown class"),
    "unknown model key": (["--model.learning_rate", "0.1"], "learning_rate"),
    "unknown data key": (["--data.init_args.num_users", "5"], "num_users"),
    "unknown top-level key": (["--foo", "1"], "foo"),
    "lr not a number": (["--model.lr", "fast"], "model.lr"),
    "negative lr": (["--model.lr", "-0.1"], "lr must be positive"),
    "zero lr": (["--model.lr", "0"], "lr must be positive"),
    "zero batch size": (["--model.batch_size", "0"], "batch_size must be positive"),
    "batch size not an int": (["--model.batch_size", "2.5"], "batch_size"),
    "zero eval_every": (["--model.eval_every", "0"], "eval_every must be positive"),
    "negative momentum": (["--model.momentum", "-1"], "must be ≥ 0"),
    "aggregation not a choice": (["--model.aggregation", "median"], "aggregation"),
    "dropout above 1": (["--model.client_dropout", "1.5"], "probability"),
    "straggler budget zero": (["--model.straggler_budget", "0"], "straggler_budget"),
    "zero clients": (["--data.init_args.num_clients", "0"], "num_clients must be ≥ 1"),
    "participation above 1": (["--data.init_args.participation", "1.5"], "participation must be in (0, 1]"),
    "participation zero": (["--data.init_args.participation", "0"], "participation must be in (0, 1]"),
    "zero clients per round": (["--data.init_args.clients_per_round", "0"], "clients_per_round must be ≥ 1"),
    "more clients per round than clients": (["--data.init_args.clients_per_round", "21"], "more than data.num_clients"),
    "shards cannot be filled": (
        ["--data.init_args.num_clients", "200", "--data.init_args.partition.init_args.classes_per_client", "10"],
        "too few to fill",
    ),
    "shards uneven": (["--data.init_args.num_clients", "7"], "do not divide evenly"),
    "more classes per client than classes": (
        ["--data.init_args.partition.init_args.classes_per_client", "11"],
        "only 10",
    ),
    "zero classes per client": (["--data.init_args.partition.init_args.classes_per_client", "0"], "must be ≥ 1"),
    "dirichlet alpha zero": (
        ["--data.init_args.partition", "datamodules.Dirichlet", "--data.init_args.partition.init_args.alpha", "0"],
        "alpha must be positive",
    ),
    "unknown client optimizer": (["--model.client_optimizer", "torch.optim.Adamm"], "unknown class 'Adamm'"),
    "client optimizer wrong argument": (
        ["--model.client_optimizer", "torch.optim.Adam", "--model.client_optimizer.init_args.lrr", "0.1"],
        "model.client_optimizer.lrr: unknown key",
    ),
    "client optimizer bad value": (
        ["--model.client_optimizer", "torch.optim.Adam", "--model.client_optimizer.lr", "-1"],
        "Adam cannot be used: Invalid learning rate",
    ),
    "client optimizer needs a closure": (["--model.client_optimizer", "torch.optim.LBFGS"], "LBFGS cannot be used"),
    "client state not elementwise": (
        ["--model.client_optimizer", "torch.optim.Adafactor", "--model.keep_client_optimizer_state", "true"],
        "not elementwise",
    ),
    "unknown lr schedule": (["--model.client_lr_schedule", "torch.optim.lr_scheduler.StepLRR"], "unknown class"),
    "lr schedule missing argument": (
        ["--model.client_lr_schedule", "torch.optim.lr_scheduler.StepLR"],
        "model.client_lr_schedule: the following arguments are required: step_size",
    ),
    "lr schedule needs a metric": (
        ["--model.client_lr_schedule", "torch.optim.lr_scheduler.ReduceLROnPlateau"],
        "needs a metric",
    ),
    "unknown server optimizer": (
        ["--model.server_optimizer", "fl_lightning.server_optimizers.FedFoo"],
        "model.server_optimizer: unknown class 'FedFoo'",
    ),
    "server optimizer bad tau": (
        ["--model.server_optimizer", "fl_lightning.server_optimizers.FedYogi", "--model.server_optimizer.tau", "0"],
        "tau (τ) must be positive",
    ),
    "personal prefix matches nothing": (["--model.algorithm.init_args.personal", "[classifier.]"], "matches no"),
    "zero rounds": (["--trainer.max_steps", "0"], "max_steps"),
    "checkpoint_every zero": (["--checkpoint_every", "0"], "checkpoint_every"),
    "missing config file": (lambda tmp: ["--config", str(tmp / "nope.yaml")], "nope.yaml"),
    "yaml syntax error": (lambda tmp: ["--config", yaml_file(tmp, "model: [unclosed\n")], "bad.yaml"),
    "yaml wrong type": (lambda tmp: ["--config", yaml_file(tmp, "model:\n  lr: [1, 2]\n")], "model.lr"),
    "missing resume checkpoint": (["--ckpt_path", "last", "--run_dir", "/nonexistent/run"], "no checkpoint"),
    "resume file missing": (["--ckpt_path", "/nonexistent/x.ckpt"], "does not exist"),
    "corrupt checkpoint file": (
        lambda tmp: ["--ckpt_path", yaml_file(tmp, "not a zip", "broken.ckpt")],
        "truncated or corrupt",
    ),
    "synthetic rank above dim": (
        [
            "--data",
            "datamodules.SyntheticLinearDataModule",
            "--data.init_args.dim",
            "2",
            "--data.init_args.rank",
            "3",
        ],
        "rank",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_input_stops_with_one_line(case, tmp_path, capsys):
    args, expected = CASES[case]
    args = args(tmp_path) if callable(args) else args
    base = ["--config", QUICK, "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]
    base += ["--run_dir", str(tmp_path / "run")] if "--run_dir" not in args else []
    code = main([*base, *args] if args[:1] != ["--config"] else [*args, *base[2:]])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and expected in errors[0], err[-2000:]
    assert "Traceback" not in err


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30
