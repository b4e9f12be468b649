"""The Table 1 method and column configs (``configs/table1/``) on tiny real-format fixtures: every method config on
every column, the networks they select, and runs through train.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from datamodules import Sent140DataModule
from datamodules.partition_report import parse, partition_report
from experiments.table1 import METHODS as METHODS_2
from experiments.table1 import REAL_COLUMNS, experiment_for
from fl_lightning.cli import main as cli_main
from fl_lightning.cli import train_config
from fl_lightning.errors import ConfigError
from tests.helpers.cifar_data import ROOT
from tests.helpers.data_fixtures import TABLE1_COLUMNS, make_fixture
from tests.helpers.heavy_ball_mlp import METHODS, error_line
from tests.helpers.loaders import glove_vectors


# ---- the method configs on every Table-1 column (dry runs on the tiny real-format fixtures) -----------------------
def table1_cell(column: str, method: str) -> list[Path]:
    """A pFL baseline on a Table-1 column: the column's config, then the method's."""
    return [Path("configs/table1") / f"{column}.yaml", Path("configs/methods") / f"{method}.yaml"]


@pytest.mark.parametrize("method", METHODS)
def test_fedbn_fedbabu_fedrod_fedala_configs_run_on_every_table1_column(method, tmp_path, capsys):
    from experiments.table1 import REAL_COLUMNS
    from tests.helpers.data_fixtures import make_fixture

    for column in REAL_COLUMNS:
        configs, overrides = table1_cell(column, method), []
        extra = [*overrides, *make_fixture(column, tmp_path / column), "--model.eval_last=1"]
        extra += ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false"]
        extra += ["--model.algorithm.init_args.local_epochs=1", "--run_dir", str(tmp_path / f"run_{column}")]
        extra += ["--model.finetune.epochs=1"] if method == "fedbabu" else []
        if method == "fedbn" and not column.startswith("cifar"):  # no BatchNorm variant: one line, exit code 2
            args = [a for c in configs for a in ("--config", str(c))]
            assert cli_main([*args, *extra]) == 2
            line = error_line(capsys.readouterr().err)
            assert "has no BatchNorm variant" in line and "FedBN needs" in line
            continue
        summary = train_config(configs, extra)
        assert summary["rounds"] == 1 and 0.0 <= summary["last10"] <= 1.0 and not math.isnan(summary["last10"])


def test_fedbn_configs_select_the_batchnorm_variant_of_the_columns_network():
    import yaml

    for column, wide in (("cifar10_100x2", False), ("cifar100_100x5", True)):
        configs = table1_cell(column, "fedbn")
        merged: dict = {}
        for c in configs:
            net = yaml.safe_load(open(c))["model"].get("network", {})
            merged.update(net.get("init_args", {}))
            merged.setdefault("class_path", net.get("class_path"))
        assert merged["class_path"] == "fl_lightning.models.CifarCNN" and merged["batchnorm"] is True
        assert merged.get("wide", False) is wide
    digits_net = yaml.safe_load(open("configs/digits/fedbn.yaml"))["model"]["network"]
    assert digits_net == {"class_path": "fl_lightning.models.DigitsCNN", "init_args": {"batchnorm": True}}


@pytest.mark.parametrize(
    "column",
    ["cifar10_100x2", "cifar10_100x5", "cifar10_1000x2", "cifar100_100x5", "cifar100_100x20", "sent140_183x2",
     "femnist_150x3"],
)  # fmt: skip
def test_pfedme_fedproto_moon_feddyn_configs_run_on_every_table1_column(column, tmp_path):
    from tests.helpers.data_fixtures import make_fixture

    fixture = make_fixture(column, tmp_path)
    for method in ("pfedme", "fedproto", "moon", "feddyn"):
        cheap = ["--model.algorithm.init_args.inner_steps", "1", "--model.algorithm.init_args.local_steps", "2"]
        summary = train_config(
            [f"configs/table1/{column}.yaml", f"configs/methods/{method}.yaml"],
            [*fixture, *(cheap if method == "pfedme" else []), "--trainer.max_steps=1", "--trainer.logger=false",
             "--trainer.enable_checkpointing=false", "--model.eval_last=1"],
            run_dir=tmp_path / method,
        )  # fmt: skip
        assert summary["rounds"] == 1 and 0.0 <= summary["last10"] <= 1.0, (column, method)


# ---- Table 1 configs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("column", TABLE1_COLUMNS)
def test_table1_config_builds_on_fixture(tmp_path, column):
    config = ROOT / "configs" / "table1" / f"{column}.yaml"
    full = yaml.safe_load(config.read_text())
    assert "algorithm" not in full["model"] and full["model"]["lr"] == 0.01 and full["model"]["momentum"] == 0.5
    args = ["--config", str(config), *make_fixture(column, tmp_path)]
    dm, _, _ = parse(args)  # the same YAML and overrides as train.py; non-data keys are ignored
    dm.setup("fit")
    rep = partition_report(dm)
    part = full["data"]["init_args"]["partition"]
    if part["class_path"].endswith("Shards"):
        s = part["init_args"]["classes_per_client"]
        assert rep["classes_per_client"] == {"mean": float(s), "min": s, "max": s}
    if part["class_path"].endswith("LogNormal"):
        sizes = np.array(rep["train_sizes"]) + np.array(rep["test_sizes"])
        assert sizes.mean() == 14 and sizes.min() >= 6 and rep["num_classes"] == 10


@pytest.mark.parametrize("column", ["cifar10_100x2", "sent140_183x2"])
def test_fedrep_end_to_end_through_train(tmp_path, column):
    from fl_lightning.cli import run

    method = tmp_path / "fedrep.yaml"
    algorithm = {"class_path": "fl_lightning.algorithms.FedRep", "init_args": {"head_epochs": 2, "body_epochs": 1}}
    method.write_text(yaml.safe_dump({"model": {"algorithm": algorithm}}))
    run_dir = tmp_path / "run"
    args = ["--config", str(ROOT / "configs" / "table1" / f"{column}.yaml"), "--config", str(method),
            *make_fixture(column, tmp_path), "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--run_dir", str(run_dir)]  # fmt: skip
    summary = run(args)
    assert summary["algorithm"] == "FedRep" and summary["rounds"] == 2 and 0 <= summary["final"] <= 1
    report = json.loads((run_dir / "partition" / "partition.json").read_text())
    assert (run_dir / "partition" / "partition.png").exists()
    hparams = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert hparams["partition/hash"] == report["hash"]


@pytest.mark.slow
def test_missing_data_is_one_line_error_through_train(tmp_path, monkeypatch, capsys):
    """In this process (``cli.main``, what train.py calls; tests/cli/test_cli.py checks train.py's own exit code)."""
    method = tmp_path / "fedrep.yaml"
    method.write_text("model:\n  algorithm:\n    class_path: fl_lightning.algorithms.FedRep\n")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    code = cli_main(["--config", "configs/table1/cifar100_100x5.yaml", "--config", str(method),
                     "--data.init_args.data_dir", str(tmp_path / "absent"), "--run_dir", str(tmp_path / "run")])
    stderr = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1
    assert "cifar-100-python" in errors[0] and "download: true" in errors[0]


def sent140_table1_run(tmp_path: Path, *extra: str) -> tuple[dict, Sent140DataModule]:
    """Two FedAvg rounds of ``configs/table1/sent140_183x2.yaml`` on the fake LEAF Sent140 + GloVe fixture;
    returns the last checkpoint's state dict and the data module built from the same arguments."""
    from datamodules.partition_report import parse
    from fl_lightning.cli import train_config
    from tests.helpers.data_fixtures import make_fixture

    root = Path(__file__).resolve().parents[2]
    config = root / "configs" / "table1" / "sent140_183x2.yaml"
    args = [*make_fixture("sent140_183x2", tmp_path), *extra]
    train_config(
        [config, root / "configs" / "methods" / "fedavg.yaml"],
        [*args, "--trainer.max_steps", "2", "--trainer.logger", "false", "--checkpoint_every", "1",
         "--model.eval_last", "1"],
        run_dir=tmp_path / "run",
    )  # fmt: skip
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    dm = parse(["--config", str(config), *args])[0]  # train.py's arguments; the report ignores --model.*
    dm.setup("fit")
    return state["state_dict"], dm


def test_sent140_table1_config_trains_with_the_frozen_glove_embedding(tmp_path):
    state, dm = sent140_table1_run(tmp_path)
    glove = glove_vectors(Path(dm.glove_path))
    weight = state["net.body.embedding.weight"]
    vocab = dm.tokenizer.get_vocab()
    used = [w for w in vocab if w in glove]
    assert len(used) >= 10 and weight.shape == (64, 16)
    for w in used:  # after two rounds at lr 0.01 the GloVe rows are still exactly GloVe's
        assert torch.equal(weight[vocab[w]], torch.tensor(glove[w])), w
    assert weight[vocab["[PAD]"]].abs().sum() == 0 and weight[vocab["[UNK]"]].abs().sum() == 0
    # the control: the same run with a trainable embedding moves the rows of the tweets' words
    moved, _ = sent140_table1_run(tmp_path / "trainable", "--model.network.init_args.freeze_embedding", "false")
    changed = [w for w in used if not torch.equal(moved["net.body.embedding.weight"][vocab[w]], weight[vocab[w]])]
    assert changed


def test_sent140_table1_config_names_a_missing_glove_file(tmp_path):
    from fl_lightning.cli import train_config
    from tests.helpers.data_fixtures import make_fixture

    missing = tmp_path / "glove.6B.300d.txt"
    args = [*make_fixture("sent140_183x2", tmp_path), "--data.init_args.glove_path", str(missing)]
    with pytest.raises(ConfigError) as info:
        train_config(["configs/table1/sent140_183x2.yaml", "configs/methods/fedavg.yaml"], args, run_dir=tmp_path)
    assert str(missing) in str(info.value) and "\n" not in str(info.value)


COLUMNS = sorted(p.stem for p in (ROOT / "configs" / "table1").glob("*.yaml"))


# issue 17's pFL baselines have method configs too, outside FedRep's Table 1 (their tests dry-run them on every column)
PFL_BASELINES = {"fedbn", "fedbabu", "fedrod", "fedala", "pfedme", "fedproto", "moon", "feddyn"}


def test_every_method_and_column_has_a_config():
    stems = {p.stem for p in (ROOT / "configs" / "methods").glob("*.yaml")}
    assert sorted(stems - PFL_BASELINES) == sorted(m for _, m in METHODS_2)
    assert sorted(COLUMNS) == sorted(REAL_COLUMNS)
    for column in ["digits", *REAL_COLUMNS]:
        experiment = experiment_for(column)
        assert [p.label for p in experiment.axes["method"]] == [m for _, m in METHODS_2]
        assert [p.value for p in experiment.axes["seed"]] == [0, 1, 2]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    cache: dict[str, list[str]] = {}

    def get(column: str) -> list[str]:
        if column not in cache:
            cache[column] = make_fixture(column, tmp_path_factory.mktemp(column))
        return cache[column]

    return get


@pytest.mark.parametrize("column", REAL_COLUMNS)
@pytest.mark.parametrize("method", [m for _, m in METHODS_2])
def test_dry_run(column, method, fixtures, tmp_path):
    run = next(r for r in experiment_for(column).runs() if r.labels["method"] == method and r.seed == 0)
    configs, overrides = run.configs, run.overrides
    # keep the runner's per-column settings (they are parsed and validated), then make the round cheap
    cheap = ["--model.algorithm.init_args." + ("body_epochs" if method == "fedrep" else "local_epochs"), "1"]
    cheap += ["--model.algorithm.init_args.head_epochs", "1"] if method == "fedrep" else []
    cheap += ["--model.finetune.epochs", "1"] if method.endswith("_ft") else []
    summary = train_config(
        configs,
        [
            *overrides,
            *fixtures(column),
            *cheap,
            "--trainer.max_steps=1",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--model.eval_last=1",
        ],
        run_dir=tmp_path,
    )
    assert summary["rounds"] == 1
    assert 0.0 <= summary["last10"] <= 1.0 and not math.isnan(summary["last10"])
    assert ("final_ft" in summary) == method.endswith("_ft")  # "+FT": an evaluation at the end of the same run


def test_runner_applies_the_papers_column_settings():
    """Spec 000 §2.4 / §3.2: the dataset-specific values the experiment files add to the method configs."""
    import yaml

    def opts(column, method):
        path = ROOT / "configs" / "experiments" / f"table1_{column}.yaml"
        entry = yaml.safe_load(path.read_text())["axes"]["method"][method]
        return {k.split(".")[-1]: (f"[{','.join(v)}]" if isinstance(v, list) else str(v))
                for k, v in entry.items() if k != "config"}  # fmt: skip

    assert opts("cifar10_100x2", "fedavg")["local_epochs"] == "1"
    assert opts("cifar10_1000x2", "fedavg")["local_epochs"] == "5"
    assert opts("cifar10_100x5", "fedrep")["body_epochs"] == "1"
    assert opts("cifar100_100x20", "fedrep")["body_epochs"] == "5"
    assert opts("femnist_150x3", "fedprox")["mu"] == opts("sent140_183x2", "fedprox_ft")["mu"] == "0.25"
    assert "mu" not in opts("cifar10_100x2", "fedprox")  # 0.1 from configs/methods/fedprox.yaml
    assert opts("femnist_150x3", "scaffold")["server_lr"] == "0.5"
    assert opts("cifar100_100x5", "ditto")["lam"] == "1.0" and "lam" not in opts("cifar10_100x2", "ditto")
    assert opts("cifar100_100x5", "l2gd")["alpha"] == "0.1" and "alpha" not in opts("cifar100_100x20", "l2gd")
    assert opts("femnist_150x3", "l2gd")["lr"] == "0.001"
    assert opts("cifar10_100x2", "lg_fedavg")["personal"] == "[body.conv1.,body.conv2.]"


def test_real_data_method_configs_use_the_papers_values_not_ones_chosen_on_digits_test_accuracy():
    """Per-FedAvg adapts with its inner lr α = 1e-4 (Fallah et al. eq. 3), not the digits config's 0.1; L2GD uses
    the paper's p, α, λ and the column's local epochs, not the digits config's 5 epochs (issue 15, item 5)."""
    import yaml

    # spec 000 §2.4, §3.2: every method runs FedRep's representation epochs: 1 on CIFAR-10 with n = 100, else 5
    epochs = {c: 1 if c in ("cifar10_100x2", "cifar10_100x5") else 5 for c in REAL_COLUMNS}

    def init_args(method):
        return yaml.safe_load((ROOT / "configs" / "methods" / f"{method}.yaml").read_text())["model"]["algorithm"][
            "init_args"
        ]

    per = init_args("perfedavg")
    assert per["inner_lr"] == 1e-4 and per.get("adapt_lr", per["inner_lr"]) == per["inner_lr"]
    l2gd = init_args("l2gd")
    assert (l2gd["p"], l2gd["alpha"], l2gd["lam"]) == (0.9, 0.25, 1.0)
    for column in REAL_COLUMNS:
        run = next(r for r in experiment_for(column).runs() if r.labels["method"] == "l2gd")
        assert f"--model.algorithm.init_args.local_epochs={epochs[column]}" in run.overrides
