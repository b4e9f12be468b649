"""What every algorithm shares (``fl_lightning/algorithms/base.py``): ``Algorithm.predict``, the documented defaults a
config that leaves them out relies on, and the one-line refusal of a network or setting a method cannot use."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fl_lightning.algorithms import FedAvg, FedPer, LGFedAvg, LocalOnly
from fl_lightning.algorithms.ifca import IFCA
from fl_lightning.cli import main
from fl_lightning.cli import main as cli_main
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite
from tests.helpers.heavy_ball_mlp import error_line


# ---- bad input: one line, exit code 2 -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "configs, overrides, message",
    [
        (["configs/digits/fedbn.yaml"], ["--model.network", "fl_lightning.models.DigitsMLP"], "FedBN needs a network"),
        (
            ["configs/digits/fedrod.yaml"],
            ["--model.network", "fl_lightning.models.ClusteredLinear", "--model.network.init_args.dim", "64"],
            "FedRoD needs a network whose `head`",
        ),
        (
            ["configs/digits/fedbabu.yaml"],
            ["--model.network", "fl_lightning.models.ClusteredLinear", "--model.network.init_args.dim", "64"],
            "FedBABU needs a network with a `head`",
        ),
        (["configs/digits/fedala.yaml"], ["--model.algorithm.init_args.p", "4"], "FedALA: p = 4 top layers"),
    ],
)
def test_a_method_on_a_network_it_cannot_use_stops_with_one_line(configs, overrides, message, tmp_path, capsys):
    args = ["--config", "configs/digits/base.yaml", *(a for c in configs for a in ("--config", c)), *overrides]
    assert cli_main([*args, "--run_dir", str(tmp_path), "--trainer.logger", "false"]) == 2
    assert message in error_line(capsys.readouterr().err)
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "checkpoints").exists()  # before training


# ---- bad input: one line, exit code 2 ---------------------------------------------------------------------------
REGRESSION = ["--config", "configs/mixed_regression/c1.yaml"]


DIGITS_RUN = ["--config", "configs/digits/base.yaml"]


BAD = {
    "FedProto on regression": (
        [*REGRESSION, "--model.algorithm", "fl_lightning.algorithms.FedProto"],
        "FedProto needs a classification task",
    ),
    "MOON without a body": ([*REGRESSION, "--model.algorithm", "fl_lightning.algorithms.MOON"], "MOON needs a network"),
    "FedProto with a side branch": (
        ["--config", "configs/perfedsi/digits.yaml", "--config", "configs/perfedsi/perfedsi_concat.yaml",
         "--model.algorithm", "fl_lightning.algorithms.FedProto", "--model.aggregation", "uniform"],
        "FedProto needs a network without a side-information branch",
    ),  # fmt: skip
    "FedDyn weighted": (
        [*DIGITS_RUN, "--config", "configs/digits/feddyn.yaml", "--model.aggregation", "num_samples"],
        "FedDyn needs model.aggregation: uniform",
    ),
    "FedProto weighted": (
        [*DIGITS_RUN, "--config", "configs/digits/fedproto.yaml", "--model.aggregation", "num_samples"],
        "FedProto needs model.aggregation: uniform",
    ),
    "pFedMe negative lambda": (
        [*DIGITS_RUN, "--config", "configs/digits/pfedme.yaml", "--model.algorithm.init_args.lam", "-1"],
        "PFedMe needs lam > 0",
    ),
    "MOON zero temperature": (
        [*DIGITS_RUN, "--config", "configs/digits/moon.yaml", "--model.algorithm.init_args.temperature", "0"],
        "MOON needs mu ≥ 0 and temperature > 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unusable_combinations_stop_before_training_with_one_line(case, tmp_path, capsys):
    args, expected = BAD[case]
    code = main([*args, "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false", "--run_dir",
                 str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and expected in errors[0], err[-2000:]
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("cls", [FedAvg, FedPer, LGFedAvg, LocalOnly])
def test_one_local_epoch_by_default(cls):
    assert cls().local_epochs == 1


def test_default_personal_prefixes():
    assert tuple(FedPer().personal) == ("head.",)  # FedPer: personal head, shared body
    assert tuple(LGFedAvg().personal) == ("body.",)  # LG-FedAvg: personal lower layers, shared head
    assert tuple(FedAvg().personal) == ()


class _SideNet(nn.Module):
    """``(x W^T + b) · scale + side``: a linear layer, a buffer, and the side information when given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("scale", torch.tensor(3.0, dtype=torch.float64))

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        out = self.lin(x) * self.scale
        return out if side is None else out + side


def test_predict_uses_given_parameters_module_buffers_and_side() -> None:
    net = _SideNet().double()
    w = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    b = torch.tensor([0.5], dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.float64)
    side = torch.tensor([[10.0], [20.0]], dtype=torch.float64)
    params = {"lin.weight": w, "lin.bias": b}  # the buffer "scale" is left out: the module's own is used
    want = (x.numpy() @ w.numpy().T + b.numpy()) * 3.0 + side.numpy()  # [[-7.5+10], [16.5+20]]
    got = FedAvg().predict(net, params, x, side)
    assert_close_finite(got, want)
    assert_close_finite(got, np.array([[2.5], [36.5]]))
    no_side = FedAvg().predict(net, params, x, None)
    assert_close_finite(no_side, np.array([[-7.5], [16.5]]))


def test_upload_shared_default_loss_is_zero() -> None:
    alg = FedPer()
    params = {"body.w": torch.ones(2), "head.w": torch.zeros(2)}
    ctx = SimpleNamespace(num_samples=7)
    update = alg.upload_shared(params, ctx, {"head.w": torch.ones(2)})  # type: ignore[arg-type]
    assert update.loss == 0.0
    assert update.num_samples == 7
    assert list(update.upload) == ["body.w"] and list(update.state) == ["head.w"]
    assert torch.equal(update.state["head.w"], torch.zeros(2))


def test_ifca_defaults() -> None:
    alg = IFCA()
    assert alg.local_steps == 5 and alg.lr == 0.05 and alg.solver == "gd"


def test_ifca_argument_edges() -> None:
    assert IFCA(local_steps=1).local_steps == 1
    assert IFCA(lr=1e-9).lr == 1e-9
    for kw in ({"local_steps": 0}, {"local_steps": -1}, {"lr": 0.0}, {"lr": -0.1}, {"local_steps": 0, "lr": 0.05}):
        with pytest.raises(ConfigError, match="local_steps"):
            IFCA(**kw)
