"""No host syncs inside a round's client steps (issue 16): the reads of tensor values back to the host during one
vectorized round are few and do not grow with the number of local steps (1 vs 5 epochs: the same count).

On the CPU every ``item``/``float``/``int``/``bool``/``tolist``/``cpu`` call is counted (each would wait for a GPU);
with CUDA, ``torch.cuda.set_sync_debug_mode`` also catches the implicit ones (blocking copies, ``nonzero``…).
"""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

import fl_lightning.engine.stacked as executors
from datamodules import DigitsDataModule, Dirichlet
from datamodules.augment import CropFlip
from fl_lightning.algorithms import APFL, SCAFFOLD, Ditto, FedRep, PerFedAvg
from fl_lightning.engine.host_syncs import count_host_reads
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsCNN, DigitsMLP
from tests.helpers.training import fit

#: a round reads the round index, the cohort's ids and the summed statistics, and checks the new model is finite
BOUND = 4


CASES = {
    "fedrep_mlp": (lambda e: FedRep(e, 1), DigitsMLP, False, "loop"),
    "scaffold_mlp": (lambda e: SCAFFOLD(e), DigitsMLP, False, "loop"),
    "apfl_mlp": (lambda e: APFL(local_epochs=e), DigitsMLP, False, "loop"),
    "perfedavg_mlp": (lambda e: PerFedAvg(local_epochs=e), DigitsMLP, False, "loop"),
    "fedrep_cnn_augment_loop": (lambda e: FedRep(e, 1), DigitsCNN, True, "loop"),
    "ditto_cnn_augment_vmap": (lambda e: Ditto(local_epochs=e), DigitsCNN, True, "vmap"),
}


class AugmentedDigits(DigitsDataModule):
    def setup(self, stage=None):
        super().setup(stage)
        self.federated.augment = CropFlip(1)


def reads_per_round(make, network, augment, epochs, device="cpu", monitor=count_host_reads):
    """The reads of each training_step (one round) of a short vectorized run."""
    per_round = []
    original = FederatedModule.training_step

    def counted(module, batch, batch_idx):
        with monitor() as reads:
            original(module, batch, batch_idx)
        per_round.append(reads.count)

    L.seed_everything(0, verbose=False)
    module = FederatedModule(make(epochs), network(), executor="vectorized", eval_every=100, eval_last=0)
    data = (AugmentedDigits if augment else DigitsDataModule)(
        num_clients=30, partition=Dirichlet(0.5), clients_per_round=4, seed=0
    )
    try:
        FederatedModule.training_step = counted
        fit(module, data, rounds=2, accelerator=device)
    finally:
        FederatedModule.training_step = original
    return per_round


@pytest.mark.parametrize("case", list(CASES))
def test_a_vectorized_round_reads_the_host_a_few_times_whatever_the_local_steps(case, monkeypatch):
    make, network, augment, conv = CASES[case]
    monkeypatch.setitem(executors.CONV_CLIENTS, "cpu", conv)
    one, five = (reads_per_round(make, network, augment, epochs) for epochs in (1, 5))
    assert one == five, (one, five)  # 5× the local steps, the same reads
    assert max(one) <= BOUND, one


def test_the_counter_counts_every_kind_of_read_and_restores_torch():
    t = torch.arange(3.0)
    with count_host_reads() as reads:
        float(t[0]), int(t[1]), bool(t[2]), t.tolist(), t[0].item(), t.cpu(), t.numpy()
        t + 1  # arithmetic is not a read
    assert reads.count == 7 and set(reads.by_method) == {
        "__float__", "__int__", "__bool__", "tolist", "item", "cpu", "numpy"
    }
    assert "__float__" not in torch.Tensor.__dict__ and float(t[1]) == 1.0  # the class is as it was
    assert reads.count == 7


class SyncWarnings:
    """``torch.cuda.set_sync_debug_mode("warn")`` for a block: counts every synchronising CUDA call."""

    def __enter__(self):
        self.caught = warnings.catch_warnings(record=True)
        self.records = self.caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self.caught.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum("synchroniz" in str(w.message) for w in self.records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["fedrep_mlp", "fedrep_cnn_augment_loop", "ditto_cnn_augment_vmap"])
def test_a_vectorized_round_on_cuda_synchronises_as_often_with_5_epochs_as_with_1(case):
    """Every synchronising CUDA call of a round (the four reads, Lightning's logged scalars, …): as many with 5×
    the local steps. Convolutions are vmap-ed over clients on CUDA (``CONV_CLIENTS``). A first fit warms the case
    up and is not counted: the first use of a kernel in a process may synchronise once (seen on an H200: [15, 14]
    with 1 epoch, then [14, 14] with 5, in the process's first case)."""
    make, network, augment, _ = CASES[case]
    reads_per_round(make, network, augment, 1, device="gpu", monitor=SyncWarnings)
    one, five = (reads_per_round(make, network, augment, e, device="gpu", monitor=SyncWarnings) for e in (1, 5))
    assert one == five, (one, five)
    assert max(one) <= 32, one
