"""train.py and ``fl_lightning/cli.py`` end to end: the quickstart, overrides, --print_config, resume, one run per run
dir, the multi-GPU plumbing that can be checked without a GPU, and malformed configs that stop with one line and
exit code 2."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fl_lightning.cli import distributed_strategy, main, set_tf32
from fl_lightning.engine.evaluation import ClientEvaluation
from fl_lightning.wandb_files import offline_runs
from tests.helpers.training import train_here

ROOT = Path(__file__).resolve().parents[2]


QUICK = ["--config", "configs/quickstart.yaml", "--trainer.enable_progress_bar", "false"]


def train(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def quickstart_offline(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One ``train.py`` quickstart run (3 rounds) in a subprocess with W&B offline: the real entry point, shared by
    the result-table and the W&B-directory checks (one interpreter start instead of two)."""
    run_dir = tmp_path_factory.mktemp("quickstart") / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *QUICK, "--trainer.max_steps", "3", "--run_dir", str(run_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out, run_dir


@pytest.mark.slow
def test_quickstart_prints_the_result_table(quickstart_offline):
    out, tmp_path = quickstart_offline
    assert out.returncode == 0, out.stderr[-2000:]
    assert "algorithm" in out.stdout and "FedRep" in out.stdout and "last10" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 3 and 0 <= summary["last10"] <= 1
    assert (tmp_path / "metrics.csv").exists()
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "config.yaml").exists()
    history = json.loads((tmp_path / "history.json").read_text())
    assert [h["round"] for h in history] == [0, 1, 2] and history[-1]["val/acc_mean"] == summary["final"]


@pytest.mark.slow
def test_print_config_round_trips(monkeypatch, capsys):
    """In this process (what train.py calls): jsonargparse prints the resolved config and exits with 0."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    with pytest.raises(SystemExit) as exit_:
        main([*QUICK, "--model.lr", "0.05", "--print_config"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None)
    assert "lr: 0.05" in out and "fl_lightning.algorithms.FedRep" in out


@pytest.mark.slow
def test_resume_with_ckpt_path_last_continues_to_the_same_result(tmp_path, monkeypatch):
    """In this process (``cli.main``, what train.py calls; the real entry point resumes a killed run below)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    assert main([*QUICK, "--trainer.max_steps", "6", "--run_dir", str(tmp_path / "full")]) == 0
    part = [*QUICK, "--trainer.max_steps", "3", "--run_dir", str(tmp_path / "part"), "--checkpoint_every", "3"]
    assert main(part) == 0
    resumed = [*QUICK, "--trainer.max_steps", "6", "--run_dir", str(tmp_path / "part"), "--ckpt_path", "last"]
    assert main(resumed) == 0
    a = json.loads((tmp_path / "full" / "summary.json").read_text())
    b = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"]) == (b["final"], b["last10"], b["rounds"])


BAD_INPUTS = {
    "unknown algorithm": (["--model.algorithm", "fl_lightning.algorithms.FedFoo"], "unknown class"),
    "unknown short algorithm": (["--model.algorithm", "FedFoo"], "unknown class"),
    "unknown dataset": (["--data", "datamodules.ImageNet42"], "unknown class"),
    "too many clients per round": (["--data.init_args.clients_per_round", "21"], "more than data.num_clients"),
    "unfillable shards": (
        ["--data.init_args.num_clients", "200", "--data.init_args.partition.init_args.classes_per_client", "10"],
        "too few to fill",
    ),
    "participation above 1": (["--data.init_args.participation", "1.5"], "participation"),
    "negative lr": (["--model.lr", "-0.1"], "lr must be positive"),
    "personal prefix matches nothing": (["--model.algorithm.init_args.personal", "[classifier.]"], "matches no"),
    "unknown key": (["--model.learning_rate", "0.1"], "learning_rate"),
    "missing resume checkpoint": (["--ckpt_path", "last"], "no checkpoint"),  # in the test's fresh run dir
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gives_a_one_line_error(case, monkeypatch, capsys, tmp_path):
    """In this process (``fl_lightning.cli.main``, what train.py calls); the real entry point is checked below. The
    run dir is a fresh one (a finished ``runs/quickstart`` from ``make train`` would be refused first)."""
    from fl_lightning.cli import main

    args, expected = BAD_INPUTS[case]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    code = main([*QUICK, "--trainer.max_steps", "1", "--run_dir", str(tmp_path / "run"), *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], err[-2000:]
    assert "Traceback" not in err


@pytest.mark.slow
def test_train_py_itself_gives_the_one_line_error_and_exit_code_2():
    args, expected = BAD_INPUTS["unknown key"]
    out = train(*QUICK, "--trainer.max_steps", "1", *args)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_wandb_offline_run_directory_is_written(quickstart_offline):
    out, tmp_path = quickstart_offline
    assert out.returncode == 0, out.stderr[-2000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


QUICK_2 = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.enable_progress_bar", "false"]


def train_2(run_dir: Path, *args: str) -> int:
    """``train.py`` in this process (WANDB_MODE from the environment: disabled unless a test sets it)."""
    return train_here([*QUICK_2, "--run_dir", str(run_dir), *args])


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def per_step(path: Path, key: str) -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in csv_rows(path) if r.get(key)}


def test_client_spread_matches_an_independent_computation():
    rng = np.random.default_rng(0)
    acc = rng.uniform(0.2, 1.0, size=37)
    loss = rng.uniform(0.1, 3.0, size=37)
    samples = rng.integers(1, 50, size=37).astype(float)
    samples[[3, 11, 20]] = 0  # clients without test data do not count
    result = ClientEvaluation(5, torch.tensor(acc), torch.tensor(loss), 0.0, 0.0, 0.0, torch.tensor(samples))
    have = samples > 0
    a, l_ = acc[have], loss[have]
    k = math.ceil(0.1 * have.sum())  # 34 clients with data -> the worst 4
    assert k == 4
    spread = result.spread()
    assert spread["acc_std"] == pytest.approx(np.sqrt(np.mean((a - a.mean()) ** 2)), abs=1e-12)
    assert spread["acc_worst10"] == pytest.approx(np.sort(a)[:k].mean(), abs=1e-12)
    assert spread["acc_min"] == pytest.approx(a.min(), abs=1e-12)
    reg = result.spread(regression=True)
    assert reg["mse_std"] == pytest.approx(l_.std(), abs=1e-12)
    assert reg["mse_worst10"] == pytest.approx(np.sort(l_)[-k:].mean(), abs=1e-12)
    assert reg["mse_max"] == pytest.approx(l_.max(), abs=1e-12)
    few = ClientEvaluation(0, torch.tensor([0.5, 0.9]), torch.zeros(2), 0.0, 0.0, 0.0, torch.tensor([3.0, 4.0]))
    assert few.spread()["acc_worst10"] == 0.5  # at least one client


def test_logged_spread_and_final_figures_match_the_per_client_file(tmp_path):
    """The last evaluation's val/acc_std, val/acc_worst10, val/acc_min in metrics.csv and the summary's final_*
    equal numpy over clients.csv (the final per-client accuracies)."""
    assert train_2(tmp_path, "--trainer.max_steps", "3") == 0
    clients = csv_rows(tmp_path / "clients.csv")
    assert [int(c["client"]) for c in clients] == list(range(20))
    acc = np.array([float(c["accuracy"]) for c in clients if int(c["samples"]) > 0])
    worst = np.sort(acc)[: math.ceil(0.1 * len(acc))].mean()
    last = max(per_step(tmp_path / "metrics.csv", "val/acc_mean"))
    logged = {k: per_step(tmp_path / "metrics.csv", f"val/{k}")[last] for k in ("acc_mean", "acc_std", "acc_worst10",
                                                                               "acc_min")}  # fmt: skip
    assert logged["acc_mean"] == pytest.approx(acc.mean(), abs=1e-6)  # float32 in the CSV
    assert logged["acc_std"] == pytest.approx(acc.std(), abs=1e-6)
    assert logged["acc_worst10"] == pytest.approx(worst, abs=1e-6)
    assert logged["acc_min"] == pytest.approx(acc.min(), abs=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_std"] == pytest.approx(acc.std(), abs=1e-12)
    assert summary["final_worst10"] == pytest.approx(worst, abs=1e-12)
    assert summary["final_min"] == pytest.approx(acc.min(), abs=1e-12)
    history = [h["val/acc_mean"] for h in json.loads((tmp_path / "history.json").read_text())]
    assert summary["best"] == max(history) and summary["rounds"] == 3
    uploads = per_step(tmp_path / "metrics.csv", "comm/upload_bytes")
    assert summary["upload_bytes"] == pytest.approx(sum(uploads.values()))


def test_a_run_dir_holds_one_run(tmp_path, capsys):
    assert train_2(tmp_path, "--trainer.max_steps", "2") == 0
    summary = (tmp_path / "summary.json").read_text()
    stamp = (tmp_path / "summary.json").stat().st_mtime_ns
    capsys.readouterr()

    assert train_2(tmp_path, "--trainer.max_steps", "2") == 2  # a second run into the same dir
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ckpt_path last" in err[0] and "--overwrite" in err[0] and str(tmp_path) in err[0]

    assert train_2(tmp_path, "--trainer.max_steps", "2", "--ckpt_path", "last") == 0  # resuming a finished run
    assert "nothing to resume" in capsys.readouterr().out
    assert train_2(tmp_path, "--trainer.max_steps", "2", "--trainer.fast_dev_run", "true") == 0
    assert (tmp_path / "summary.json").read_text() == summary  # neither shrinks nor overwrites it
    assert (tmp_path / "summary.json").stat().st_mtime_ns == stamp
    assert len(csv_rows(tmp_path / "metrics.csv")) > 0

    assert train_2(tmp_path, "--trainer.max_steps", "3", "--overwrite", "true") == 0
    assert json.loads((tmp_path / "summary.json").read_text())["rounds"] == 3
    assert sorted(per_step(tmp_path / "metrics.csv", "val/acc_mean")) == [0, 1, 2]

    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "checkpoints" / "round00001.ckpt").write_bytes(b"")  # an unfinished run: a checkpoint to resume
    assert train_2(other, "--trainer.max_steps", "2") == 2
    assert "holds an unfinished run" in capsys.readouterr().err and "--overwrite true" in err[0]
    (other / "checkpoints" / "round00001.ckpt").unlink()
    (other / "metrics.csv").write_text("step\n0\n")  # a run that stopped before its first checkpoint: reused
    assert train_2(other, "--trainer.max_steps", "2") == 0
    assert "starting it afresh" in capsys.readouterr().out


@pytest.mark.slow
def test_a_killed_run_resumes_into_one_wandb_run_and_a_complete_metrics_csv(tmp_path, monkeypatch, capsys):
    rounds = ["--trainer.max_steps", "12", "--checkpoint_every", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}  # fmt: skip
    victim_dir = tmp_path / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), *QUICK_2, *rounds, "--run_dir", str(victim_dir)]
    victim = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (victim_dir / "checkpoints" / "round00004.ckpt").exists():
            assert victim.poll() is None, "the run finished before it could be killed"
            assert time.time() < deadline
            time.sleep(0.02)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
    assert not (victim_dir / "summary.json").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")  # the resume runs in this process (cli.main, what train.py calls)
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train_2(victim_dir, *rounds, "--ckpt_path", "last") == 0
    capsys.readouterr()

    deadline = time.monotonic() + 60
    while not (runs := offline_runs(victim_dir))[-1].exited and time.monotonic() < deadline:
        time.sleep(0.1)  # W&B's service may still be writing the resumed run's file
    # one W&B run, written by two processes (W&B loses what the killed process had not flushed yet; the
    # resumed process logs every round it recomputes, metrics.csv keeps them all)
    assert len(runs) == 2 and len({r.id for r in runs}) == 1
    assert runs[-1].id == (victim_dir / "wandb_id").read_text().strip() and runs[-1].name == "killed"
    assert [row["trainer/global_step"] for row in runs[-1].history if "val/acc_mean" in row][-1] == 11

    full = tmp_path / "full"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert train_2(full, *rounds) == 0  # the same run, never interrupted (W&B disabled)
    for key in ("val/acc_mean", "val/acc_std", "train/loss"):
        got, want = per_step(victim_dir / "metrics.csv", key), per_step(full / "metrics.csv", key)
        assert sorted(got) == list(range(12)) and got == pytest.approx(want, abs=1e-6), key
    steps = [int(r["step"]) for r in csv_rows(victim_dir / "metrics.csv") if r.get("val/acc_mean")]
    assert steps == list(range(12))  # every round once: the rows logged after the checkpoint were replaced
    a = json.loads((victim_dir / "summary.json").read_text())
    b = json.loads((full / "summary.json").read_text())
    assert (a["final"], a["last10"], a["rounds"], a["upload_bytes"]) == (b["final"], b["last10"], b["rounds"],
                                                                          b["upload_bytes"])  # fmt: skip


def test_wandb_gets_histograms_the_client_table_and_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert train_2(tmp_path, "--trainer.max_steps", "5", "--wandb.histogram_every", "2") == 0
    capsys.readouterr()
    (run,) = offline_runs(tmp_path, wait_s=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    ran = summary.pop("ran")  # what ran goes to the run's config, beside the settings that asked for it
    assert {k[len("summary/"):]: v for k, v in run.summary.items() if k.startswith("summary/")} == summary
    assert run.config["ran"] == ran and ran["executor"] == "stacked" and ran["batch"] is None
    steps = [row["trainer/global_step"] for row in run.history if "val/acc_clients/values" in row]
    assert len(steps) == 3  # evaluations 2 and 4, and the last round
    histogram = next(row for row in run.history if "val/acc_clients/values" in row)
    assert sum(histogram["val/acc_clients/values"]) == 20  # one entry per client with test data
    table = json.loads((run.files[0].parent / "files" / run.summary["clients/final"]["path"]).read_text())
    assert table["columns"] == ["client", "samples", "accuracy", "loss"]
    clients = csv_rows(tmp_path / "clients.csv")
    assert [[int(r[0]), int(r[1]), r[2]] for r in table["data"]] == [
        [int(c["client"]), int(c["samples"]), pytest.approx(float(c["accuracy"]))] for c in clients
    ]
    assert run.summary["val/acc_min"] == pytest.approx(summary["final_min"], abs=1e-6)


def test_a_logger_from_the_config_gets_the_full_config(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if "wandb" in sys.modules:  # W&B keeps the settings of its first setup in this process (an earlier test's mode)
        sys.modules["wandb"].teardown()
    logger = {"class_path": "lightning.pytorch.loggers.WandbLogger",
              "init_args": {"save_dir": str(tmp_path / "mine"), "project": "mine", "group": "g"}}  # fmt: skip
    assert train_2(tmp_path / "run", "--trainer.max_steps", "2", "--trainer.logger", json.dumps(logger)) == 0
    capsys.readouterr()
    (run,) = offline_runs(tmp_path / "mine", wait_s=60)
    assert run.project == "mine" and run.group == "g"
    assert run.config["data"]["class_path"] == "datamodules.DigitsDataModule"
    assert run.config["model"]["algorithm"]["class_path"] == "fl_lightning.algorithms.FedRep"
    assert run.config["trainer"]["max_steps"] == 2


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_cli_builds_ddp_without_the_per_forward_buffer_broadcast():
    from lightning.pytorch.strategies import DDPStrategy

    strategy = distributed_strategy({"strategy": "ddp"})["strategy"]
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs["broadcast_buffers"] is False
    assert distributed_strategy({"strategy": "auto"}) == {} and distributed_strategy({}) == {}


@pytest.fixture
def restore_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_one_tf32_policy_switches_cuda_matmuls_and_convolutions_together(restore_tf32):
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    set_tf32(False)
    # the legacy flags, not torch.get_float32_matmul_precision(): that getter raises once any earlier code in the
    # process has used the per-backend fp32_precision API (e.g. a second in-process pytest run under mutmut)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    set_tf32(True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu  # CPU math untouched


def test_train_py_and_the_experiment_runner_apply_the_policy_from_the_config(restore_tf32, tmp_path, monkeypatch):
    """Both go through ``cli.run``; ``--tf32`` is part of the run's config (and so of its saved config.yaml)."""
    from fl_lightning import cli

    seen = []
    monkeypatch.setattr(cli, "set_tf32", lambda enabled: seen.append(enabled))
    for value in ("false", "true"):
        cli.train_config(
            ["configs/quickstart.yaml"],
            ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
             "--model.eval_last=0", "--model.eval_every=100", f"--tf32={value}"],
            run_dir=tmp_path / value,
        )  # fmt: skip
    assert seen == [False, True]


@pytest.mark.parametrize("name", ["gpu", "multi_gpu", "slurm"])
def test_gpu_trainer_configs_are_deterministic(name):
    trainer = yaml.safe_load((CONFIGS / "trainer" / f"{name}.yaml").read_text())["trainer"]
    assert trainer["deterministic"] == "warn" and trainer["benchmark"] is False


def test_table1_configs_evaluate_every_10_rounds_and_the_last_10():
    columns = sorted((CONFIGS / "table1").glob("*.yaml"))
    assert len(columns) == 7
    for path in columns:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["trainer"]["val_check_interval"] == 10 and cfg["model"]["eval_last"] == 10, path.name


QUICK_3 = str(ROOT / "configs/quickstart.yaml")


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
    "missing resume checkpoint": (["--ckpt_path", "last"], "no checkpoint"),  # in the test's fresh run dir
    "resume file missing": (lambda tmp: ["--ckpt_path", str(tmp / "nowhere" / "x.ckpt")], "does not exist"),
    # issue 45: a choice key names the value and the choices, a range error its one key, value and where it was set
    "choice key": (["--model.aggregation", "foo"],
                   "model.aggregation: value 'foo' given, expected one of uniform, num_samples; fix:"),
    "executor choice": (["--model.executor", "bar"], "expected one of auto, sequential, vectorized"),
    "negative momentum, named alone": (["--model.momentum", "-1"],
                                       "model.momentum must be ≥ 0, got -1.0 (--model.momentum)"),
    "negative eval_last": (["--model.eval_last", "-2"], "model.eval_last must be an integer ≥ 0"),
    "unknown partition class": (["--data.init_args.partition", "datamodules.FooPartition"],
                                "data.partition: unknown class 'datamodules.FooPartition' (known partitions:"),
    "config is a folder": (lambda tmp: ["--config", str(tmp)], "is a folder, not a config file"),
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
    base = ["--config", QUICK_3, "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false"]
    base += ["--run_dir", str(tmp_path / "run")] if "--run_dir" not in args else []
    code = main([*base, *args] if args[:1] != ["--config"] else [*args, *base[2:]])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and expected in errors[0], err[-2000:]
    assert "Traceback" not in err


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


#: W&B's banner and footer (issue 45): its version, where it keeps logs, its sparkline history and summary
WANDB_BANNER = ("Tracking run with wandb", "syncing is set to `offline`", "Run data is saved locally", "wandb leet",
                "Run history:", "Run summary:", "Find logs at", "You can sync this run")  # fmt: skip


@pytest.mark.slow
def test_wandb_says_where_the_offline_run_is_in_one_line_unless_its_own_output_is_asked_for(tmp_path):
    """W&B offline with neither WANDB_SILENT nor WANDB_QUIET set (a user's first run): a fit and a validate print no
    line of W&B's banner or footer, and one line each naming the offline run's folder and the command that uploads
    it (the folder exists); with ``WANDB_SILENT=false`` W&B's own banner and footer are back and the line is not."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_SILENT", "WANDB_QUIET")}
    env["WANDB_MODE"] = "offline"
    quick = [*QUICK, "--trainer.max_steps", "1", "--model.algorithm.init_args.head_epochs", "1"]

    def command(*args: str, **more: str) -> tuple[str, str]:
        out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env={**env, **more},
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout, out.stderr

    run = str(tmp_path / "run")
    for args in ([*quick, "--run_dir", run], ["validate", *quick, "--run_dir", run, "--ckpt_path", "last"]):
        stdout, stderr = command(*args)
        banner = [line for line in (stdout + stderr).splitlines() if any(b in line for b in WANDB_BANNER)]
        assert banner == [], banner
        where = [line for line in (stdout + stderr).splitlines() if line.startswith("wandb:")]
        assert len(where) == 1, where
        folder = where[0].split("wandb: offline run in ", 1)[1].split(";")[0]
        assert where[0] == f"wandb: offline run in {folder}; upload it with: wandb sync {folder}"
        assert Path(folder).parent == (tmp_path / "run" / "wandb").resolve() and Path(folder).is_dir()
    stdout, stderr = command(*quick, "--run_dir", str(tmp_path / "asked"), WANDB_SILENT="false")
    assert "Tracking run with wandb" in stderr and "You can sync this run" in stderr
    assert "wandb: offline run in" not in stdout + stderr


#: third-party lines a user cannot act on (issue 45): none may reach the console of a run, a resume or a test
NOISE = ("anonymous setting", "Trainer.fit` stopped", "exists and is not empty", "weights_only", "Be aware that",
         "Restored all states", "Loaded model weights", "Warning", "warn(")  # fmt: skip


@pytest.mark.slow
def test_the_console_of_a_run_a_resume_and_a_test_shows_the_run_only(tmp_path):
    """With W&B offline as under ``make`` (``WANDB_SILENT``) and Python's warnings on (no ``PYTHONWARNINGS``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    run_dir = tmp_path / "run"

    def command(*args: str) -> str:
        out = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--run_dir", str(run_dir)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stderr

    quick = [*QUICK, "--checkpoint_every", "1", "--model.algorithm.init_args.head_epochs", "1"]
    consoles = [
        command(*quick, "--trainer.max_steps", "2"),
        command(*quick, "--trainer.max_steps", "3", "--ckpt_path", "last", "--checkpoint_every", "2"),
        command("test", *quick, "--ckpt_path", str(run_dir / "checkpoints" / "round00002.ckpt")),
    ]
    for stderr in consoles:
        noise = [line for line in stderr.splitlines() if any(n in line for n in NOISE)]
        assert noise == [], noise
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints'}" in consoles[1]


# ---- one parser per process: reused by later runs (fl_lightning.cli.parser_key, take_parser) ------------------------
DIGITS = ROOT / "configs" / "digits"


def _cli_args(tmp_path: Path, method: str, *more: str) -> list[str]:
    return ["--config", str(DIGITS / "base.yaml"), "--config", str(DIGITS / f"{method}.yaml"),
            "--run_dir", str(tmp_path / method), *more]  # fmt: skip


def _what_lightning_dumped(cli) -> tuple[str, dict, dict]:
    """config.yaml, the checkpoints' hyper-parameters and the run's full config as the three dumps of Lightning's
    SaveConfigCallback, its ``_dump_config`` and this CLI wrote them before they were one dump."""
    text = cli.parser.dump(cli.config, skip_none=False)
    hparams = yaml.safe_load(cli.parser.dump(cli.config, skip_link_targets=False, skip_none=False, format="yaml"))
    full = json.loads(cli.parser.dump(cli.config, skip_none=False, format="json"))
    return text, hparams, full


def test_config_yaml_is_the_text_dumped_when_the_run_was_instantiated(tmp_path):
    """A run's config.yaml holds the one dump of its resolved config, byte for byte what the parser writes for it."""
    from fl_lightning.cli import make_cli, train_config

    run_dir = tmp_path / "run"
    train_config([DIGITS / "base.yaml", DIGITS / "fedavg.yaml"], ["--trainer.max_steps", "1"], run_dir=run_dir)
    same = _cli_args(tmp_path, "fedavg", "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1")
    text, _, _ = _what_lightning_dumped(make_cli("fit", same))
    assert (run_dir / "config.yaml").read_text() == text.replace(str(tmp_path / "fedavg"), str(run_dir))
