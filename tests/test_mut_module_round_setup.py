"""``FederatedModule.attach_data``, ``executor.client_context`` and ``executor.decide`` called directly on tiny
hand-built data.

``attach_data`` binds the data once per federation size (re-attaching the same size keeps the client-state bank),
adds the kept client-optimiser state to the bank when asked, places the bank and the per-client scores on the
module's device (``meta`` stands in for an accelerator), tells DDP to ignore the bank's buffers, hands the ground
truth to the algorithm and describes the side-information branch in the privacy ledger. ``client_context`` gives a
client its own rows of the chosen split, its side vector, the augmentation on training data only, the run's seed
and the straggler budget. ``decide`` says whether the stacked path applies and logs a fallback once.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_close_finite
from torch import Tensor, nn

from fl_lightning.algorithms import FedAvg
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.engine.executor import client_context, decide
from fl_lightning.engine.module import FederatedModule
from fl_lightning.models import DigitsMLP
from fl_lightning.models.split import Concat, SplitModel

TRAIN_SIZES = (3, 4, 5, 2)
TEST_SIZES = (2, 1, 3, 2)


def _split(sizes: tuple[int, ...], seed: int) -> ClientSplit:
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    ptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.long)
    return ClientSplit(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), ptr)


def _augment(x: Tensor, g: torch.Generator) -> Tensor:
    return x + torch.randn(x.shape, generator=g)


def _fed(clients: int = 4, side: bool = False, seed: int = 7, extras: dict[str, Tensor] | None = None) -> FederatedData:
    train, test = _split(TRAIN_SIZES[:clients], 1), _split(TEST_SIZES[:clients], 2)
    side_t = torch.arange(clients * 3, dtype=torch.float32).reshape(clients, 3) if side else None
    return FederatedData(train, test, 10, seed, side_t, _augment, extras or {})


def _rows(sizes: tuple[int, ...], c: int) -> tuple[int, int]:
    lo = sum(sizes[:c])
    return lo, lo + sizes[c]


# ---- attach_data ---------------------------------------------------------------------------------------------
def test_reattaching_the_same_federation_keeps_the_bank_and_a_new_size_rebuilds_it() -> None:
    """Attach is idempotent: a second attach with the same number of clients keeps the bank (and a row written into
    it); a federation of another size gets a fresh bank of that size."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed(4))
    bank = module.bank
    assert bank.num_clients == 4
    bank.row("head.bias")[2] += 5.0
    written = bank.row("head.bias")[2].clone()
    module.attach_data(_fed(4))
    assert module.bank is bank
    assert_close_finite(module.bank.row("head.bias")[2], written)
    module.attach_data(_fed(3))
    assert module.bank is not bank and module.bank.num_clients == 3
    assert module.bank.row("head.bias").shape[0] == 3


def _sgd_tensor_state_keys(momentum: float) -> set[str]:
    """The per-parameter tensor state keys of ``torch.optim.SGD`` after one step (the reference)."""
    p = torch.zeros(2, 3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=momentum)
    p.grad = torch.ones_like(p)
    opt.step()
    return {k for k, v in opt.state[p].items() if isinstance(v, Tensor)}


def test_kept_client_optimizer_state_adds_zero_rows_for_every_trainable_parameter() -> None:
    """``keep_client_optimizer_state``: the bank holds, next to the personal head, a step counter and every SGD
    momentum buffer (shaped like its parameter, zero) for each trainable parameter, none for a frozen one."""
    net = DigitsMLP(hidden=(4,))
    frozen = [n for n, _ in net.named_parameters() if n.startswith("body.")][-1]
    net.get_parameter(frozen).requires_grad_(False)
    module = FederatedModule(FedAvg(1, personal=["head."]), net, momentum=0.5, keep_client_optimizer_state=True)
    module.attach_data(_fed(4))
    trainable = {n: p for n, p in net.named_parameters() if p.requires_grad}
    keys = _sgd_tensor_state_keys(0.5)
    assert keys == {"momentum_buffer"}
    expected = {"head.weight", "head.bias"}
    expected |= {f"client_optimizer.steps.{n}" for n in trainable}
    expected |= {f"client_optimizer.{k}.{n}" for n in trainable for k in keys}
    assert set(module.bank.names) == expected
    assert frozen not in trainable
    for n, p in trainable.items():
        buf = module.bank.row(f"client_optimizer.momentum_buffer.{n}")
        assert buf.shape == (4, *p.shape)
        assert not buf.any()
        assert module.bank.row(f"client_optimizer.steps.{n}").shape == (4,)


def test_bank_and_client_scores_go_to_the_modules_device() -> None:
    """The bank and the per-client scores are built on the module's device (``meta`` stands in for a GPU)."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module._device = torch.device("meta")
    module.attach_data(_fed(4))
    buffers = list(module.bank.buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers)
    for name in ("correct", "total", "loss_sum"):
        assert getattr(module.client_scores, name).device.type == "meta"


def test_ddp_ignores_exactly_the_banks_buffers() -> None:
    """DDP is told to skip every buffer of the client-state bank (named as the module names them), nothing else."""
    module = FederatedModule(FedAvg(1, personal=["head."]), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed(4))
    expected = [n for n, _ in module.named_buffers() if n.startswith("bank.")]
    assert len(expected) == 2
    assert module._ddp_params_and_buffers_to_ignore == expected


class _GroundTruthRecorder(FedAvg):
    """FedAvg that keeps what ``bind_ground_truth`` received."""

    def bind_ground_truth(self, extras: dict[str, Tensor]) -> None:
        self.bound = extras


def test_the_algorithm_receives_the_datas_ground_truth() -> None:
    extras = {"B_star": torch.eye(3)}
    algorithm = _GroundTruthRecorder(1)
    module = FederatedModule(algorithm, DigitsMLP(hidden=(4,)))
    module.attach_data(_fed(4, extras=extras))
    assert algorithm.bound is extras


class _Plain(nn.Module):
    """A network without any ``side`` attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 10)

    def forward(self, x: Tensor, side: Tensor | None = None) -> Tensor:
        return self.lin(x)


def _concat_net() -> SplitModel:
    return SplitModel(nn.Linear(64, 4), nn.Linear(6, 10), Concat(nn.Linear(3, 2)))


def test_ledger_side_information_follows_the_side_branch() -> None:
    """Side data and a ``Concat`` branch: the ledger states what ``Concat`` reveals and treats every upload as
    side-dependent; side data and a network without a declaring branch: "side information"; no side data: none."""
    module = FederatedModule(FedAvg(1), _concat_net())
    module.attach_data(_fed(4, side=True))
    assert module.ledger.side_reveals == Concat.reveals
    assert module.ledger.side_dependent == ("",)
    assert module.ledger.describe().endswith("; " + Concat.reveals)

    for net in (_Plain(), DigitsMLP(hidden=(4,))):
        module = FederatedModule(FedAvg(1), net)
        module.attach_data(_fed(4, side=True))
        assert module.ledger.side_reveals == "side information"
        assert module.ledger.side_dependent == ("",)

    module = FederatedModule(FedAvg(1), _concat_net())
    module.attach_data(_fed(4, side=False))
    assert module.ledger.side_reveals is None
    assert module.ledger.side_dependent == ()


# ---- client_context ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def attached() -> tuple[FederatedModule, FederatedData]:
    fed = _fed(4, side=True, seed=7)
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    module.attach_data(fed)
    return module, fed


def test_training_context_reads_the_clients_training_rows(attached: tuple[FederatedModule, FederatedData]) -> None:
    """Defaults: the training split, the augmentation, a full step budget, the run's seed, the client's side."""
    module, fed = attached
    ctx = client_context(module, 2, 3)
    lo, hi = _rows(TRAIN_SIZES, 2)
    assert_close_finite(ctx.x, fed.train.x[lo:hi])
    assert torch.equal(ctx.y, fed.train.y[lo:hi])
    assert_close_finite(ctx.side, torch.tensor([6.0, 7.0, 8.0]))
    assert ctx.augment is _augment
    assert (ctx.client, ctx.round, ctx.seed, ctx.step_budget) == (2, 3, 7, 1.0)


def test_test_context_reads_the_test_rows_without_augmentation(attached: tuple[FederatedModule, FederatedData]) -> None:
    module, fed = attached
    ctx = client_context(module, 1, 0, split="test", tag="eval", step_budget=0.25)
    lo, hi = _rows(TEST_SIZES, 1)
    assert ctx.x.shape[0] == TEST_SIZES[1]
    assert_close_finite(ctx.x, fed.test.x[lo:hi])
    assert torch.equal(ctx.y, fed.test.y[lo:hi])
    assert ctx.augment is None
    assert_close_finite(ctx.side, torch.tensor([3.0, 4.0, 5.0]))
    assert (ctx.seed, ctx.step_budget) == (7, 0.25)


def test_context_without_side_data_has_no_side() -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)))
    module.attach_data(_fed(4, side=False))
    assert client_context(module, 0, 0).side is None


# ---- vectorized ----------------------------------------------------------------------------------------------
def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fl_lightning" and r.levelno == logging.WARNING]


def test_vectorized_applies_to_a_vectorizable_method_without_batchnorm(caplog: pytest.LogCaptureFixture) -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is True
        assert decide(module, 2).stacked is True
    assert _warnings(caplog) == []


def test_sequential_executor_is_never_vectorized(caplog: pytest.LogCaptureFixture) -> None:
    module = FederatedModule(FedAvg(1), DigitsMLP(hidden=(4,)), executor="sequential")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
    assert _warnings(caplog) == []


class _Inherits(FedAvg):
    """A subclass of a vectorizable method that does not declare ``vectorizable`` itself."""


def test_a_subclass_must_declare_vectorizable_itself_and_the_fallback_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    module = FederatedModule(_Inherits(1), DigitsMLP(hidden=(4,)), executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
        assert decide(module, 2).stacked is False
    assert _warnings(caplog) == [
        "executor 'vectorized' falls back to 'sequential': _Inherits is not marked vectorizable"
    ]


def test_batchnorm_network_falls_back_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    net = nn.Sequential(nn.Linear(64, 4), nn.BatchNorm1d(4), nn.Linear(4, 10))
    module = FederatedModule(FedAvg(1), net, executor="vectorized")
    with caplog.at_level(logging.WARNING, logger="fl_lightning"):
        assert decide(module, 2).stacked is False
        assert decide(module, 2).stacked is False
    assert _warnings(caplog) == ["executor 'vectorized' falls back to 'sequential': the network has BatchNorm layers"]
