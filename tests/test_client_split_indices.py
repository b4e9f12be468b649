"""``ClientSplit.from_indices``: index sets of any integer-valued form (an empty float tensor, as
``torch.tensor([])`` makes, included) gather the right rows, and zero clients give an empty split."""

from __future__ import annotations

import torch

from fl_lightning.engine.client_data import ClientSplit


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
