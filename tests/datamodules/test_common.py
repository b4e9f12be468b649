"""``datamodules/common.py``: the shared build of the dataset modules on pools written here: classes kept and
relabelled, class-disjoint transfer clients, held-out clients cut by the same partition, natural owners, and the
one-line refusals."""

from __future__ import annotations

import pytest
import torch

from datamodules.common import PartitionedDataModule, Pools
from datamodules.partition import Natural, Shards
from fl_lightning.errors import ConfigError


class Tiny(PartitionedDataModule):
    """6 classes, 20 training and 10 test samples each; ``x`` holds the class and a sample index, owners by index."""

    def load(self) -> Pools:
        y_tr, y_te = torch.arange(6).repeat_interleave(20), torch.arange(6).repeat_interleave(10)
        x_tr = torch.stack([y_tr.float(), torch.arange(120.0)], 1)
        x_te = torch.stack([y_te.float(), torch.arange(60.0)], 1)
        g_tr, g_te = torch.arange(120) % 3, torch.arange(60) % 3
        return Pools(x_tr, y_tr, x_te, y_te, 6, g_tr, g_te, ["ann", "bob", "cy"])


def _classes_of(split) -> set[int]:
    return {int(c) for c in split.x[:, 0]}  # the original class is kept in x


def test_kept_classes_are_relabelled_in_the_given_order():
    dm = Tiny(num_clients=4, partition=Shards(2), classes=[5, 1], write_report=False, seed=0)
    dm.setup("fit")
    fed = dm.federated
    assert fed.num_classes == 2 and _classes_of(fed.train) == {5, 1} and _classes_of(fed.test) == {5, 1}
    assert torch.equal(fed.train.y, (fed.train.x[:, 0] == 1).long())  # class 5 → 0, class 1 → 1
    assert fed.train.x.shape[0] == 40 and dm.new_clients is None


def test_transfer_classes_go_to_new_clients_only():
    dm = Tiny(num_clients=4, partition=Shards(2), transfer_classes=[4, 5], transfer_clients=2, write_report=False,
              seed=0)  # fmt: skip
    dm.setup("fit")
    fed, new = dm.federated, dm.new_clients
    assert _classes_of(fed.train) == {0, 1, 2, 3} and _classes_of(new.train) == {4, 5}
    assert new.num_clients == 2 and fed.num_classes == new.num_classes == 4
    assert torch.equal(new.train.y, new.train.x[:, 0].long() - 4)  # 4 → 0, 5 → 1
    for c in range(2):  # Shards(2) over the two transfer classes: each new client holds both, equally
        _, y = new.train.client(c)
        assert torch.bincount(y, minlength=2).tolist() == [10, 10]


def test_held_out_clients_are_cut_by_the_same_partition_and_leave_the_federation():
    dm = Tiny(num_clients=4, partition=Shards(3), holdout_clients=2, write_report=False, seed=1)
    dm.setup("fit")
    fed, new = dm.federated, dm.new_clients
    assert fed.num_clients == 4 and new.num_clients == 2
    seen = torch.cat([fed.train.x[:, 1], new.train.x[:, 1]])
    assert sorted(seen.tolist()) == list(range(120))  # every training sample once, in one of the two
    for c in range(2):
        assert len(torch.unique(new.train.client(c)[1])) == 3  # Shards(3): three classes each, as the others


def test_natural_clients_carry_their_owner():
    dm = Tiny(num_clients=3, partition=Natural(), write_report=False, seed=0)
    dm.setup("fit")
    owners = dm.federated.extras["group"]
    assert sorted(dm.client_groups) == ["ann", "bob", "cy"]
    for c in range(3):
        x, _ = dm.federated.train.client(c)
        assert set((x[:, 1].long() % 3).tolist()) == {int(owners[c])}
        assert dm.client_groups[c] == ["ann", "bob", "cy"][int(owners[c])]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(holdout_clients=-1), "must be ≥ 0"),
        (dict(holdout_clients=1, transfer_classes=[5], transfer_clients=1), "either holdout_clients or"),
        (dict(transfer_classes=[5]), "must be given together"),
        (dict(classes=[1, 5], transfer_classes=[5], transfer_clients=1), r"overlap: \[5\]"),
    ],
)
def test_contradictory_arguments_are_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Tiny(num_clients=4, write_report=False, **kwargs)


def test_a_class_outside_the_dataset_is_refused_at_build():
    with pytest.raises(ConfigError, match=r"Tiny.classes: \[9\] not in 0..5"):
        Tiny(num_clients=2, classes=[1, 9], write_report=False, seed=0).setup("fit")
