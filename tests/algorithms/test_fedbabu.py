"""FedBABU (Oh et al. 2022; ``fl_lightning/algorithms/fedbabu.py``) against references written here: its arguments and
defaults, its client update on one client, and its runs through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from fl_lightning.algorithms import FedBABU
from fl_lightning.client import ClientOptimizer
from fl_lightning.engine.module import FineTune
from fl_lightning.engine.rounds import make_generator
from fl_lightning.errors import ConfigError
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import SplitModel
from tests.helpers.asserts import assert_close_finite
from tests.helpers.clients import client_context
from tests.helpers.heavy_ball_mlp import BODY, HEAD, MLP, TOL, far, fit, local_sgd, mlp_forward, scores, weighted_mean


def fedbabu_reference(init: dict, dm, rounds: int, epochs: int, trained: list[str], ft_epochs: int, ft: list[str]):
    """FedBABU: local SGD on the body with the random head fixed, average the bodies; then every client fine-tunes
    ``ft`` for ``ft_epochs`` from the global model and is scored once."""
    fed, glob = dm.federated, dict(init)
    for _ in range(rounds):
        models = [local_sgd(glob, trained, *fed.train.client(c), epochs) for c in range(fed.num_clients)]
        sizes = [fed.train.client(c)[0].shape[0] for c in range(fed.num_clients)]
        glob = {**glob, **weighted_mean(models, sizes, trained)}
    evaluation = []
    for c in range(fed.num_clients):
        tuned = local_sgd(glob, ft, *fed.train.client(c), ft_epochs)
        x, y = fed.test.client(c)
        evaluation.append(scores(mlp_forward(tuned, x), y))
    return glob, evaluation


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedbabu_trains_the_body_through_a_fixed_random_head_then_fine_tunes_the_head(executor):
    torch.manual_seed(0)
    finetune = FineTune(epochs=2, prefixes=("head.",))
    module, dm, init = fit(FedBABU(local_epochs=2), DigitsMLP(hidden=(16,)), 2, finetune=finetune, executor=executor)
    assert set(module.ledger.allowed) == set(BODY)  # the head is never uploaded
    glob, evaluation = fedbabu_reference(init, dm, 2, 2, BODY, 2, HEAD)
    net = module.global_params()
    for n in BODY:
        assert_close_finite(net[n], glob[n], **TOL, msg=n)
    for n in HEAD:
        assert torch.equal(net[n], init[n]), n  # the random head never moves
    # "+FT": the head fine-tuned for 2 epochs per client on the trained body, scored once (the run's result)
    result = module.evaluate_clients(1, finetune=finetune)
    for c, (acc, loss) in enumerate(evaluation):
        assert float(result["acc_per_client"][c]) == pytest.approx(acc, abs=1e-9)
        assert float(result["loss_per_client"][c]) == pytest.approx(loss, rel=1e-4)
    assert module.summary["algorithm"] == "FedBABU+FT" and module.summary["final_ft"] == pytest.approx(
        float(result["acc_mean"]), abs=1e-12
    )  # the "+FT" figure under its own name (issue 31); final is the plain run's
    # role swaps: training the head with the body (FedAvg), or fine-tuning the whole network
    fedavg, _ = fedbabu_reference(init, dm, 2, 2, MLP, 2, HEAD)
    assert far(net, fedavg, BODY) > 1e-3
    _, whole = fedbabu_reference(init, dm, 2, 2, BODY, 2, MLP)
    assert max(abs(a[1] - b[1]) for a, b in zip(whole, evaluation)) > 1e-3


D, N = 2, 4


def half_mse(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def problem() -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.randn(N, generator=g, dtype=torch.float64)
    glob = {
        "body.weight": torch.tensor([[0.5, -0.25]], dtype=torch.float64),
        "head.weight": torch.tensor([[2.0]], dtype=torch.float64),
    }
    return x, y, glob


def test_defaults_and_setup_needs_a_head() -> None:
    assert FedBABU().local_epochs == 1
    _, _, glob = problem()
    FedBABU().setup(glob, 3)
    with pytest.raises(ConfigError, match="head"):
        FedBABU().setup({"body.weight": glob["body.weight"], "headless.w": torch.ones(1)}, 3)


def test_client_update_trains_the_body_through_the_fixed_head() -> None:
    x, y, glob = problem()
    lr = 0.3
    net = SplitModel(nn.Linear(D, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    opt = ClientOptimizer(lr=lr, momentum=0.9, batch_size=8)  # one batch: the first step is −lr·∇
    ctx = client_context(net, x, y, optimizer=opt, loss=half_mse, generator=make_generator(0, "babu"))
    alg = FedBABU()
    up = alg.client_update(ctx, glob, {})

    w, h = glob["body.weight"].numpy()[0], float(glob["head.weight"])
    r = h * (x.numpy() @ w) - y.numpy()
    grad_w = h * x.numpy().T @ r / N
    assert set(up.upload) == {"body.weight"}
    assert_close_finite(up.upload["body.weight"], (w - lr * grad_w)[None, :])
    assert_close_finite(float(up.loss), 0.5 * np.mean(r**2))
    assert up.state == {} and up.num_samples == N
    assert set(alg.upload_template(glob)) == {"body.weight"}
    assert set(alg.download_template(glob)) == {"body.weight"}
    assert alg.download_template(glob)["body.weight"] is glob["body.weight"]
