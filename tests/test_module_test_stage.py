"""``trainer.test`` on a ``FederatedModule``: the data follow the network's dtype, the test evaluation is the one
of the last trained round (the same numbers as the last validation on the test split, "+FT" included), and the
representation distance is logged under ``test/``.

References: plain-torch accuracies per client, a numpy principal-angle distance, and, for the round index, the
run's own last validation (an exact property: testing right after training evaluates the same round again).
"""

from __future__ import annotations

import lightning as L
import numpy as np
import torch
from conftest import make_trainer
from helpers import assert_close_finite

from datamodules import DigitsDataModule, Shards, SyntheticLinearDataModule
from fl_lightning.algorithms import FedAvg
from fl_lightning.client import ClientContext, Params
from fl_lightning.engine.module import FederatedModule, FineTune
from fl_lightning.models import DigitsMLP, LinearRepresentation


def _mean_client_accuracy(net: torch.nn.Module, split) -> float:
    accs = []
    with torch.no_grad():
        for c in range(split.num_clients):
            x, y = split.client(c)
            if len(y):
                accs.append(float((net(x.to(torch.float64)).argmax(-1) == y).double().mean()))
    return sum(accs) / len(accs)


def test_test_in_64_bit_precision_casts_the_data_and_scores_each_client() -> None:
    """``precision: 64-true`` without a fit: the float32 client data are cast to float64 for testing, and
    ``test/acc_mean`` is the mean over clients of the float64 network's accuracy on each client's test rows."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(8,)))
    (tested,) = make_trainer(1, precision="64-true").test(module, datamodule=dm, verbose=False)
    assert next(module.net.parameters()).dtype == torch.float64
    expected = _mean_client_accuracy(module.net, dm.federated.test)
    assert_close_finite(tested["test/acc_mean"], expected, rtol=1e-6, atol=1e-7)


class _NoisyAdapt(FedAvg):
    """FedAvg whose evaluation adapts each client's model by noise drawn from the client's evaluation generator
    (seeded from the round), so the evaluation depends on which round it is said to be."""

    def adapt_for_evaluation(self, ctx: ClientContext, params: Params) -> Params:
        out = dict(params)
        for n in ("head.bias",):
            out[n] = params[n] + 2.0 * torch.randn(params[n].shape, generator=ctx.generator).to(params[n])
        return out


def test_test_after_fit_repeats_the_last_rounds_evaluation_and_finetune() -> None:
    """Right after a 2-round fit (no validation split, so validation reads the test split), ``trainer.test``
    gives the last validation's accuracy and loss, and its ``test/acc_ft`` is the run's "+FT" result, for round 1."""
    L.seed_everything(0, verbose=False)
    dm = DigitsDataModule(num_clients=5, partition=Shards(2), clients_per_round=2, seed=0)
    module = FederatedModule(
        _NoisyAdapt(1),
        DigitsMLP(hidden=(8,)),
        batch_size=5,
        finetune=FineTune(epochs=1),
        executor="sequential",
        eval_last=1,
    )
    trainer = make_trainer(2)
    trainer.fit(module, datamodule=dm)
    last = module.history[-1]
    assert module.rounds_trained == 2
    (tested,) = trainer.test(module, datamodule=dm, verbose=False)
    assert_close_finite(tested["test/acc_mean"], last["val/acc_mean"], rtol=1e-6, atol=1e-7)
    assert_close_finite(tested["test/loss"], last["val/loss"], rtol=1e-6, atol=1e-7)
    assert module.finetuned_clients.round == 1
    assert_close_finite(tested["test/acc_ft"], module.summary["final_ft"], rtol=1e-6, atol=1e-7)


def test_test_logs_the_representation_distance() -> None:
    """Synthetic linear data with a ground-truth representation: ``test/dist_B`` is the largest principal angle's
    sine between B* and the network's representation, ‖(I − Q₁Q₁ᵀ)Q₂‖₂ with Q the orthonormal bases."""
    L.seed_everything(0, verbose=False)
    dm = SyntheticLinearDataModule(num_clients=4, dim=6, rank=2, samples_per_client=5, participation=0.5, seed=0)
    module = FederatedModule(FedAvg(1), LinearRepresentation(6, 2), aggregation="uniform")
    (tested,) = make_trainer(1).test(module, datamodule=dm, verbose=False)
    b_star = dm.federated.extras["B_star"].numpy()
    b = module.net.representation.detach().double().numpy()
    q1, q2 = np.linalg.qr(b_star)[0], np.linalg.qr(b)[0]
    expected = np.linalg.svd((np.eye(6) - q1 @ q1.T) @ q2, compute_uv=False)[0]
    assert_close_finite(tested["test/dist_B"], expected, rtol=1e-5, atol=1e-6)


def test_on_test_start_moves_the_data_to_the_modules_device() -> None:
    """``on_test_start`` puts every client split on the module's device (the ``meta`` device stands in for an
    accelerator: on the CPU the two are the same), in the network's dtype, with the shapes unchanged."""
    dm = SyntheticLinearDataModule(num_clients=4, dim=6, rank=2, samples_per_client=5, participation=0.5, seed=0)
    dm.setup("test")
    module = FederatedModule(FedAvg(1), LinearRepresentation(6, 2), aggregation="uniform")
    module.attach_data(dm.federated)
    before = dm.federated.test.x.shape
    module._device = torch.device("meta")
    module.on_test_start()
    for split in (module.fed.train, module.fed.test):
        assert split.x.device.type == "meta" and split.y.device.type == "meta"
        assert split.x.dtype == next(module.net.parameters()).dtype
    assert module.fed.test.x.shape == before
