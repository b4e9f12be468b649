"""What a Lightning user expects works: the validation loop (val_check_interval, EarlyStopping, ModelCheckpoint
on a validation metric), validate/test subcommands, precision, a quiet console and a fast --help."""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision

from datamodules import DigitsDataModule, Shards
from fl_lightning.algorithms import FedAvg, FedRep
from fl_lightning.engine.evaluation import ClientChunks
from fl_lightning.engine.module import FederatedModule
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from tests.helpers.training import fit, make_trainer, train_here

ROOT = Path(__file__).resolve().parents[2]


QUICK = str(ROOT / "configs/quickstart.yaml")


QUIET = ["--trainer.enable_progress_bar", "false"]


# FedAvg with a large step: the accuracy goes up and down (round 3 is the best of 8 with this seed)
BUMPY = """\
seed_everything: 0
trainer: {{max_steps: 8, accelerator: cpu, callbacks: {callbacks}}}
model:
  algorithm: {{class_path: fl_lightning.algorithms.FedAvg, init_args: {{local_epochs: 1}}}}
  network: {{class_path: fl_lightning.models.DigitsMLP}}
  lr: 0.3
  momentum: 0.9
data:
  class_path: datamodules.DigitsDataModule
  init_args: {{num_clients: 10, clients_per_round: 3, partition: {{class_path: datamodules.Shards}}}}
"""


def cli(*args: str) -> int:
    """``train.py ARGS`` in this process (return code; output goes to capsys/capfd)."""
    return train_here([*args])


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def val_steps(run_dir: Path, key: str = "val/acc_mean") -> list[int]:
    return [int(r["step"]) for r in csv_rows(run_dir / "metrics.csv") if r.get(key)]


def error_line(captured: str) -> str:
    lines = [ln for ln in captured.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, captured[-2000:]
    return lines[0]


# ---- validation loop ---------------------------------------------------------------------------------------
def test_val_check_interval_5_logs_validation_every_5_rounds_and_in_the_last_rounds(tmp_path):
    args = [QUICK, *QUIET, "--trainer.max_steps", "12", "--model.eval_last", "2", "--checkpoint_every", "5"]
    assert cli("--config", *args, "--trainer.val_check_interval", "5", "--run_dir", str(tmp_path / "a")) == 0
    rows = csv_rows(tmp_path / "a" / "metrics.csv")
    assert [int(r["step"]) for r in rows if r.get("train/loss")] == list(range(12))  # every round trains
    assert val_steps(tmp_path / "a") == [4, 9, 10, 11]  # rounds 5, 10 and the last two; logged once each
    history = json.loads((tmp_path / "a" / "history.json").read_text())
    assert [h["round"] for h in history] == [4, 9, 10, 11]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["last10"] == pytest.approx((history[-1]["val/acc_mean"] + history[-2]["val/acc_mean"]) / 2)
    # model.eval_every is the old name of trainer.val_check_interval: same schedule, same numbers
    assert cli("--config", *args, "--model.eval_every", "5", "--run_dir", str(tmp_path / "b")) == 0
    assert json.loads((tmp_path / "b" / "history.json").read_text()) == history


def test_early_stopping_stops_a_plateauing_run_before_max_steps(tmp_path, capsys):
    config = tmp_path / "early.yaml"
    config.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.EarlyStopping\n"
        "      init_args: {monitor: val/acc_mean, patience: 3, mode: max}\n"
    )
    run_dir = tmp_path / "run"
    # lr 1e-12 changes no float32 weight: the accuracy is exactly flat from the first round on
    args = ["--config", QUICK, "--config", str(config), *QUIET, "--trainer.max_steps", "30", "--model.lr", "1e-12"]
    assert cli(*args, "--run_dir", str(run_dir)) == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    history = json.loads((run_dir / "history.json").read_text())
    assert summary["rounds"] == 4 < 30  # the best round, then 3 without improvement
    assert [h["round"] for h in history] == [0, 1, 2, 3] and len({h["val/acc_mean"] for h in history}) == 1
    assert max(int(r["step"]) for r in csv_rows(run_dir / "metrics.csv")) == 3


def test_model_checkpoint_on_val_acc_keeps_the_best_round(tmp_path, capsys):
    callbacks = (
        "[{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: "
        f"{{monitor: val/acc_mean, mode: max, save_top_k: 1, dirpath: {tmp_path / 'best'}, filename: best}}}}]"
    )
    config = tmp_path / "bumpy.yaml"
    config.write_text(BUMPY.format(callbacks=callbacks))
    run_dir = tmp_path / "run"
    # the sequential reference: lr 0.3 with momentum 0.9 is chaotic, so the rounds' accuracies follow every rounding
    # of the training path; the reference's do not move when a fast path changes
    reference = ("--model.executor", "sequential")
    assert cli("--config", str(config), *QUIET, *reference, "--run_dir", str(run_dir)) == 0, (
        capsys.readouterr().err[-2000:]
    )
    history = json.loads((run_dir / "history.json").read_text())
    accs = [h["val/acc_mean"] for h in history]
    best = accs.index(max(accs))
    assert len(accs) == 8 and best < 7, accs  # the best round is not the last one
    saved = torch.load(tmp_path / "best" / "best.ckpt", weights_only=True, map_location="cpu")
    assert saved["global_step"] == best + 1 and saved["fl_history"][-1]["round"] == best
    assert list((tmp_path / "best").glob("*.ckpt")) == [tmp_path / "best" / "best.ckpt"]
    # evaluating that checkpoint gives the best round's accuracy again
    ckpt = str(tmp_path / "best" / "best.ckpt")
    validate = ("validate", "--config", str(config), *QUIET, *reference)
    assert cli(*validate, "--run_dir", str(run_dir), "--ckpt_path", ckpt) == 0
    result = json.loads((run_dir / "validate.json").read_text())
    assert result["round"] == best and abs(result["val/acc_mean"] - max(accs)) < 1e-6


# ---- validate / test subcommands ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 5-round quickstart run (checkpoint every 3 rounds, so last.ckpt is the end-of-fit save)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    args = ["--config", QUICK, *QUIET, "--trainer.max_steps", "5", "--checkpoint_every", "3"]
    assert cli(*args, "--run_dir", str(run_dir)) == 0
    return run_dir


@pytest.mark.slow
def test_validate_subcommand_reproduces_the_final_logged_accuracy(finished_run, capsys):
    """In this process (``cli.main``, what train.py calls; the fixture's run too)."""
    logged = [float(r["val/acc_mean"]) for r in csv_rows(finished_run / "metrics.csv") if r.get("val/acc_mean")]
    last_logged = logged[-1]
    capsys.readouterr()
    code = cli("validate", "--config", QUICK, *QUIET, "--run_dir", str(finished_run), "--ckpt_path", "last")
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    result = json.loads((finished_run / "validate.json").read_text())
    assert result["round"] == 4 and abs(result["val/acc_mean"] - last_logged) <= 1e-6
    summary = json.loads((finished_run / "summary.json").read_text())
    assert abs(result["val/acc_mean"] - summary["final"]) <= 1e-6
    assert "val/acc_mean" in out.out and str(finished_run / "validate.json") in out.out
    # the training run's metrics are untouched (validate logs into run_dir/validate/)
    assert val_steps(finished_run) == [0, 1, 2, 3, 4]
    assert (finished_run / "validate" / "metrics.csv").exists()


@pytest.mark.slow  # the module fixture is a whole 5-round run: setup time that mutmut's timing cannot see
def test_test_subcommand_evaluates_the_test_split_and_new_clients(finished_run, tmp_path):
    args = ["--config", QUICK, *QUIET, "--run_dir", str(finished_run), "--ckpt_path", "last"]
    assert cli("test", *args) == 0
    result = json.loads((finished_run / "test.json").read_text())
    summary = json.loads((finished_run / "summary.json").read_text())
    assert abs(result["test/acc_mean"] - summary["final"]) <= 1e-6 and "test/new_clients_acc" not in result
    # a DataModule with held-out clients: they are fine-tuned and evaluated too (as at the end of fit)
    new = ["--data", "tests.helpers.digits_runs.DigitsWithNewClients"]
    new += ["--data.init_args.num_clients", "20"]
    new += ["--data.init_args.participation", "0.2", "--data.init_args.partition", "datamodules.Shards"]
    assert cli("test", *args, *new) == 0
    result = json.loads((finished_run / "test.json").read_text())
    assert 0.0 <= result["test/new_clients_acc"] <= 1.0
    assert abs(result["test/acc_mean"] - summary["final"]) <= 1e-6




def test_validate_after_fit_in_python_gives_the_last_evaluation():
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)
    module = FederatedModule(FedRep(1, 1), DigitsMLP())
    trainer = make_trainer(3)
    trainer.fit(module, datamodule=dm)
    (logged,) = trainer.validate(module, datamodule=dm, verbose=False)
    assert abs(logged["val/acc_mean"] - module.history[-1]["val/acc_mean"]) < 1e-6
    assert len(module.history) == 3  # validate does not add to the training history
    assert module.last_evaluation.acc_per_client.shape == (10,)
    assert abs(float(module.last_evaluation.acc_per_client.mean()) - module.history[-1]["val/acc_mean"]) < 1e-6


# ---- bad input: one line, exit code 2 ----------------------------------------------------------------------
def monitor_config(tmp_path: Path, callback: str, monitor: str) -> list[str]:
    path = tmp_path / "monitor.yaml"
    path.write_text(
        f"trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.{callback}\n"
        f"      init_args: {{monitor: {monitor}}}\n"
    )
    return ["--config", str(path)]


BAD = {
    "validate without a checkpoint": (lambda d, t: ["validate", "--config", QUICK], "validate needs a checkpoint"),
    "test without a checkpoint": (lambda d, t: ["test", "--config", QUICK], "test needs a checkpoint"),
    "checkpoint of another algorithm": (
        lambda d, t: ["validate", "--config", QUICK, "--ckpt_path", str(d / "checkpoints" / "last.ckpt")]
        + ["--model.algorithm", "fl_lightning.algorithms.FedAvg"],
        "trained with FedRep on DigitsMLP, this config is FedAvg on DigitsMLP",
    ),
    "checkpoint of another network": (
        lambda d, t: ["validate", "--config", QUICK, "--ckpt_path", str(d / "checkpoints" / "last.ckpt")]
        + ["--model.network", "fl_lightning.models.DigitsCNN"],
        "trained with FedRep on DigitsMLP, this config is FedRep on DigitsCNN",
    ),
    "checkpoint of another network size": (
        lambda d, t: ["test", "--config", QUICK, "--ckpt_path", str(d / "checkpoints" / "last.ckpt")]
        + ["--model.network.init_args.hidden", "[32]"],
        "the checkpoint does not fit this model",
    ),
    "resume with another number of clients": (
        lambda d, t: ["--config", QUICK, "--ckpt_path", str(d / "checkpoints" / "last.ckpt")]
        + ["--data.init_args.num_clients", "10"],
        "the checkpoint has 20 clients, this config 10",
    ),
    "EarlyStopping on a key never logged": (
        lambda d, t: ["--config", QUICK, *monitor_config(t, "EarlyStopping", "val/accuracy")],
        "EarlyStopping monitors 'val/accuracy', which is never logged",
    ),
    "ModelCheckpoint on a key never logged": (
        lambda d, t: ["--config", QUICK, *monitor_config(t, "ModelCheckpoint", "val/acc")],
        "ModelCheckpoint monitors 'val/acc', which is never logged",
    ),
    "eval_every and val_check_interval disagree": (
        lambda d, t: ["--config", QUICK, "--model.eval_every", "3", "--trainer.val_check_interval", "5"],
        "disagree",
    ),
    "validation every n epochs": (
        lambda d, t: ["--config", QUICK, "--trainer.check_val_every_n_epoch", "2"],
        "a run is one epoch of rounds",
    ),
    "fp16 mixed precision": (
        lambda d, t: ["--config", QUICK, "--trainer.precision", "16-mixed"],
        "16-mixed is not supported",
    ),
}


@pytest.mark.slow  # the module fixture is a whole 5-round run: setup time that mutmut's timing cannot see
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gives_one_line_and_exit_code_2(case, finished_run, tmp_path, capsys):
    make_args, expected = BAD[case]
    code = cli(*make_args(finished_run, tmp_path), *QUIET, "--trainer.max_steps", "2", "--run_dir", str(tmp_path / "r"))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert expected in error_line(err) and "Traceback" not in err


# ---- precision ---------------------------------------------------------------------------------------------
def test_fp16_mixed_precision_is_refused_by_the_module():
    """With Lightning's fp16 GradScaler the server step would unscale an update that was never scaled."""
    module = FederatedModule(FedAvg(1), DigitsMLP())
    dm = DigitsDataModule(num_clients=4, partition=Shards(5), clients_per_round=2, seed=0)
    trainer = make_trainer(1, plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(ConfigError, match="16-mixed is not supported"):
        trainer.fit(module, datamodule=dm)


def test_bf16_mixed_trains_like_fp32():
    def run(precision):
        L.seed_everything(0, verbose=False)
        module = FederatedModule(FedRep(2, 1), DigitsMLP(), eval_last=1)
        dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=5, seed=0)
        return fit(module, dm, rounds=5, precision=precision)

    full, half = run("32-true"), run("bf16-mixed")
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in half.net.parameters())
    assert half.history[0]["val/acc_mean"] != full.history[0]["val/acc_mean"]  # bf16 autocast did run
    assert abs(half.summary["final"] - full.summary["final"]) < 0.05, (half.summary, full.summary)


@pytest.mark.parametrize("network", ["mlp", "cnn"])
def test_bf16_mixed_on_the_stacked_path_keeps_fp32_master_weights(network, monkeypatch):
    """``trainer.precision: bf16-mixed`` autocasts the clients' forward and backward passes; the stacked path's
    weights, the optimiser's update and the client-state bank stay float32. One round of stacked FedRep (1 head + 1
    body epoch, personal heads in the bank) with a learning rate so small that most weight changes are below bf16's
    resolution (2⁻⁸ of the weight): stored in bf16 they would vanish; here the round's change matches fp32's. The
    CNN runs the ``vmap``-ed step (``CONV_CLIENTS`` as on accelerators), the MLP the batched-matmul one."""
    from fl_lightning.engine import stacked
    from fl_lightning.models import DigitsCNN

    monkeypatch.setitem(stacked.CONV_CLIENTS, "cpu", "vmap")

    def network_() -> torch.nn.Module:
        return DigitsMLP(hidden=(32,)) if network == "mlp" else DigitsCNN()

    def run(precision: str) -> FederatedModule:
        L.seed_everything(0, verbose=False)
        module = FederatedModule(FedRep(1, 1), network_(), executor="vectorized", lr=1e-4)
        dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=3, seed=0)
        make_trainer(1, limit_val_batches=0, precision=precision).fit(module, datamodule=dm)
        return module

    L.seed_everything(0, verbose=False)
    init = {n: p.detach().clone() for n, p in network_().named_parameters()}
    full, half = run("32-true"), run("bf16-mixed")
    assert all(p.dtype == torch.float32 for p in half.net.parameters())
    assert all(half.bank.row(n).dtype == torch.float32 for n in half.bank.names)
    for n, p in full.global_params().items():
        if n not in init or n.startswith("head."):  # the global head is not trained (FedRep's heads are personal)
            continue
        step32, step16 = p - init[n], half.global_params()[n] - init[n]
        lost = ((init[n] + step32).bfloat16() == init[n].bfloat16()).float().mean()
        assert lost > 0.5, (n, lost)  # bf16 storage would have dropped most of this round's change
        cosine = torch.nn.functional.cosine_similarity(step16.flatten(), step32.flatten(), dim=0)
        assert cosine > 0.99 and not torch.equal(step16, step32), (n, cosine)  # autocast ran, the update survived
    heads = [half.bank.row(n) - full.bank.row(n) for n in full.bank.names]
    assert max(float(d.abs().max()) for d in heads) < 1e-3


# ---- checkpoints -------------------------------------------------------------------------------------------
def test_resuming_from_a_checkpoint_written_before_validation_says_so(tmp_path, caplog):
    def module():
        L.seed_everything(0, verbose=False)
        return FederatedModule(FedRep(1, 1), DigitsMLP())

    def data():
        return DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0)

    plain = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="r{step}")
    make_trainer(3, enable_checkpointing=True, callbacks=[plain]).fit(module(), datamodule=data())
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        resumed = module()
        make_trainer(3).fit(resumed, datamodule=data(), ckpt_path=str(next(tmp_path.glob("r*2.ckpt"))))
    assert "written before the validation of round 1" in caplog.text and "RoundCheckpoint" in caplog.text
    assert [h["round"] for h in resumed.history] == [0, 2]  # round 1 was never evaluated


def test_client_chunks_cover_every_client_once_with_the_same_count_on_every_rank():
    for num_clients, world, size in [(5, 2, 2), (20, 2, 256), (3, 4, 1), (700, 3, 256)]:
        chunks = [list(ClientChunks(num_clients, rank, world, size)) for rank in range(world)]
        assert len({len(c) for c in chunks}) == 1  # DDP: every rank runs the same number of steps
        seen = sorted(c for rank in chunks for chunk in rank for c in chunk)
        assert seen == list(range(num_clients))
        assert all(len(chunk) <= size for rank in chunks for chunk in rank)


# ---- console -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_normal_run_is_quiet_and_prints_one_line_per_round_outside_a_terminal(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1")
    args = ["--config", QUICK, "--trainer.max_steps", "3", "--checkpoint_every", "1", "--run_dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    stderr = [ln for ln in out.stderr.splitlines() if ln.strip()]
    allowed = ("GPU available:", "`Trainer.fit` stopped:", "executor: ")
    assert all(ln.startswith(allowed) for ln in stderr), stderr
    assert [ln for ln in stderr if ln.startswith("executor: ")] == [  # the engine's choice, said once
        "executor: stacked (sgd: fused relu mlp, heads on cached features; eval: shared body) because FedRep is "
        "vectorizable, 4 clients at a time on the cpu"
    ], stderr
    progress = [ln for ln in out.stdout.splitlines() if ln.startswith("round ")]
    assert [ln.split()[1] for ln in progress] == ["1/3", "2/3", "3/3"], out.stdout
    assert all("train/loss" in ln and "val/acc_mean" in ln and "s/round" in ln for ln in progress)
    assert "\r" not in out.stdout


@pytest.mark.slow
def test_help_lists_the_subcommands_without_loading_torch():
    code = "import sys; from fl_lightning.cli import main; main(['--help']); "
    code += "print(sorted({'torch', 'lightning'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]")
    assert all(word in out.stdout for word in ("fit", "validate", "test", "--ckpt_path", "--config"))


def test_subcommand_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as stop:
        cli("validate", "--help")
    assert stop.value.code == 0
    assert "--trainer.val_check_interval" in capsys.readouterr().out


def test_validation_reads_the_validation_split_when_the_data_has_one():
    """With ``val_fraction`` > 0, ``val/acc_mean`` is the mean over clients of the global FedAvg model's accuracy
    on each client's validation rows (computed here in plain torch), and ``test`` reads the test split."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=10, partition=Shards(2), clients_per_round=3, seed=0, val_fraction=0.3)
    module = FederatedModule(FedAvg(2), DigitsMLP(), lr=0.1)
    trainer = make_trainer(3)
    trainer.fit(module, datamodule=dm)

    def mean_accuracy(split):
        accs = []
        with torch.no_grad():
            for c in range(split.num_clients):
                x, y = split.client(c)
                if len(y):
                    accs.append(float((module.net(x).argmax(-1) == y).double().mean()))
        return sum(accs) / len(accs)

    fed = dm.federated
    on_val, on_test = mean_accuracy(fed.val), mean_accuracy(fed.test)
    assert abs(on_val - on_test) > 1e-3  # the two splits tell apart
    assert abs(module.history[-1]["val/acc_mean"] - on_val) < 1e-6
    (tested,) = trainer.test(module, datamodule=dm, verbose=False)
    assert abs(tested["test/acc_mean"] - on_test) < 1e-6
