"""``fl_lightning/engine/client_data.py``: ``ClientSplit`` and ``FederatedData`` construction, moves and casts."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from datamodules.base import FederatedDataModule
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from tests.helpers.stand_ins import with_trainer


def _split(n_rows: int = 5, y_float: bool = False) -> ClientSplit:
    """Three clients with rows 0:2, 2:2 (empty), 2:5; float64 features."""
    x = torch.arange(n_rows * 2, dtype=torch.float64).reshape(n_rows, 2)
    y = torch.arange(n_rows, dtype=torch.float64) if y_float else torch.arange(n_rows)
    return ClientSplit(x, y, torch.tensor([0, 2, 2, n_rows]))


def _identity_augment(x: Tensor, g: torch.Generator) -> Tensor:
    return x


def test_host_sizes_are_row_counts_of_the_named_clients() -> None:
    split = ClientSplit(torch.zeros(9, 1), torch.zeros(9), torch.tensor([0, 2, 2, 6, 9]))
    assert split.host_sizes([0, 1, 2, 3]) == [2, 0, 4, 3]
    assert split.host_sizes([3, 0]) == [3, 2]


def test_client_split_to_meta_moves_everything_and_keeps_host_offsets() -> None:
    split = _split()
    moved = split.to("meta")
    assert moved.x.device.type == moved.y.device.type == moved.ptr.device.type == "meta"
    assert moved.offsets == [0, 2, 2, 5]  # read from the host copy: a meta ptr has no values
    assert moved.host_sizes([0, 1, 2]) == [2, 0, 3]
    assert moved.client(2)[0].shape == (3, 2)


def test_client_split_to_dtype_casts_floating_x_and_y_only() -> None:
    moved = _split(y_float=True).to("cpu", torch.float32)
    assert moved.x.dtype == torch.float32 and moved.y.dtype == torch.float32
    assert moved.ptr.dtype == torch.int64
    labels = _split().to("cpu", torch.float32)
    assert labels.y.dtype == torch.int64  # integer labels stay
    assert torch.equal(labels.y, torch.arange(5))


def test_client_split_to_without_dtype_keeps_dtypes_and_moves_integer_labels() -> None:
    moved = _split().to("meta")
    assert moved.x.dtype == torch.float64 and moved.y.dtype == torch.int64
    assert moved.y.device.type == "meta"


def test_client_ids_name_the_owner_of_every_row() -> None:
    assert _split().client_ids().tolist() == [0, 0, 2, 2, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_client_ids_on_the_accelerator() -> None:
    ids = _split().to("cuda").client_ids()
    assert ids.device.type == "cuda" and ids.tolist() == [0, 0, 2, 2, 2]


def _fed(with_val: bool = True) -> FederatedData:
    return FederatedData(
        _split(y_float=True),
        _split(4, y_float=True),
        None,
        seed=3,
        side=torch.ones(3, 2, dtype=torch.float64),
        augment=_identity_augment,
        extras={"B_star": torch.ones(2, 2, dtype=torch.float64)},
        val=_split(2, y_float=True) if with_val else None,
    )


def test_federated_data_to_meta_moves_every_tensor() -> None:
    moved = _fed().to("meta")
    assert moved.side is not None and moved.side.device.type == "meta" and moved.side.shape == (3, 2)
    assert moved.extras["B_star"].device.type == "meta"
    assert moved.val is not None
    assert moved.val.x.device.type == moved.val.y.device.type == moved.val.ptr.device.type == "meta"
    assert moved.val.ptr.dtype == torch.int64 and moved.val.x.dtype == torch.float64
    assert moved.train.x.device.type == moved.test.x.device.type == "meta"
    assert moved.augment is _identity_augment
    assert moved.seed == 3 and moved.num_classes is None


def test_federated_data_to_dtype_casts_side_and_splits_but_not_extras() -> None:
    moved = _fed().to("cpu", torch.float32)
    assert moved.side is not None and moved.side.dtype == torch.float32
    assert torch.equal(moved.side, torch.ones(3, 2))
    assert moved.val is not None and moved.val.x.dtype == torch.float32 and moved.val.y.dtype == torch.float32
    assert moved.train.y.dtype == moved.test.x.dtype == torch.float32
    assert moved.extras["B_star"].dtype == torch.float64


def test_federated_data_to_meta_with_dtype_moves_and_casts_side() -> None:
    moved = _fed().to("meta", torch.float32)
    assert moved.side is not None and moved.side.device.type == "meta" and moved.side.dtype == torch.float32
    assert moved.val is not None and moved.val.x.device.type == "meta" and moved.val.x.dtype == torch.float32


def test_federated_data_to_without_side_or_val() -> None:
    fed = FederatedData(_split(), _split(), 3)
    moved = fed.to("meta")
    assert moved.side is None and moved.val is None and moved.augment is None and moved.extras == {}


def test_federated_data_moved_inside_inference_mode_can_be_trained_on() -> None:
    """Lightning's evaluation loop runs under ``torch.inference_mode``, where the data are moved and cast
    (``on_validation_start``); evaluations then adapt on them with autograd (PerFedAvg's step, "+FT"). A cast copy
    made there must be a normal tensor, or ``backward`` refuses it (PerFedAvg's test on a GPU or in 64-bit did)."""
    with torch.inference_mode():
        moved = _fed().to("cpu", torch.float32)
    splits = (moved.train, moved.test, moved.val)
    assert all(s is not None and not s.x.is_inference() and not s.y.is_inference() for s in splits)
    assert moved.side is not None and not moved.side.is_inference()
    w = torch.ones(moved.train.x.shape[1], requires_grad=True)
    (moved.train.x @ w).sum().backward()  # saves x for the gradient of w
    assert w.grad is not None and torch.equal(w.grad, moved.train.x.sum(0))


def test_evaluation_split_defaults_to_test() -> None:
    fed = _fed()
    assert fed.evaluation_split() is fed.test
    assert fed.evaluation_split("val") is fed.val


def _dm(seed: int, max_steps: int | None = 3) -> FederatedDataModule:
    dm = FederatedDataModule(num_clients=10, clients_per_round=3, seed=seed)
    with_trainer(dm, max_steps=max_steps)
    return dm


def test_train_dataloader_needs_a_trainer_with_max_steps() -> None:
    dm = FederatedDataModule(num_clients=4, clients_per_round=2, seed=0)
    assert dm.trainer is None
    with pytest.raises(ConfigError, match="max_steps"):
        dm.train_dataloader()
    for bad in (None, 0, -1):
        with pytest.raises(ConfigError, match="max_steps"):
            _dm(0, bad).train_dataloader()
    assert len(_dm(0, 1).train_dataloader()) == 1


def test_train_dataloader_cohorts_follow_the_seed() -> None:
    """Rounds 0..7 of 3 distinct clients out of 10: the same seed gives the same cohorts, another seed others."""

    def cohorts(seed: int) -> list[list[int]]:
        loader = _dm(seed, 8).train_dataloader()
        out = [batch["clients"].tolist() for batch in loader]
        assert [len(set(c)) for c in out] == [3] * 8
        assert all(0 <= i < 10 for c in out for i in c)
        return out

    a, b, c = cohorts(1), cohorts(1), cohorts(2)
    assert len(a) == 8 and a == b
    assert a != c


def test_an_empty_float_index_set_is_an_empty_client() -> None:
    x, y = torch.arange(10.0).view(5, 2), torch.tensor([4, 3, 2, 1, 0])
    split = ClientSplit.from_indices(x, y, [torch.tensor([3, 1]), torch.tensor([]), torch.tensor([0])])
    assert split.ptr.tolist() == [0, 2, 2, 3]
    assert split.y.tolist() == [1, 3, 4]
    assert torch.equal(split.x, x[[3, 1, 0]])


def test_no_clients_give_an_empty_split() -> None:
    x, y = torch.arange(10.0).view(5, 2), torch.arange(5)
    split = ClientSplit.from_indices(x, y, [])
    assert split.num_clients == 0
    assert split.ptr.tolist() == [0] and split.ptr.dtype == torch.long
    assert split.x.shape == (0, 2) and split.y.shape == (0,)
