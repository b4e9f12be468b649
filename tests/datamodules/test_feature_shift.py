"""``affine_shift`` and ``FeatureShift`` on tiny inputs: exact rotations of other tensor ranks, a full bilinear shear
(zero fill, borders included) against a numpy reference written here, ``random`` group assignment, a caller's base
partition, and 3-d image tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from datamodules.feature_shift import FeatureShift, IIDSplit, affine_shift
from datamodules.partition import IndexSets
from fl_lightning.engine.client_data import ClientSplit, FederatedData
from fl_lightning.errors import ConfigError
from tests.helpers.asserts import assert_close_finite


def _shear_reference(img: np.ndarray, shear_deg: float) -> np.ndarray:
    """Clockwise shear of ``[H, W]``: output row ``y`` (rows below the centre ``(H-1)/2``) reads the input row at
    column ``x + tan φ · y``, linearly interpolated with zeros outside; torchvision's zero ``fill`` multiplies the
    result by the interpolated in-bounds mask (the same interpolation of an all-ones image)."""
    h, w = img.shape
    t = math.tan(math.radians(shear_deg))
    out = np.zeros((h, w))
    for i in range(h):
        for j in range(w):
            s = j + t * (i - (h - 1) / 2)
            f = math.floor(s)
            frac = s - f
            val = mask = 0.0
            for col, wt in ((f, 1.0 - frac), (f + 1, frac)):
                if 0 <= col < w:
                    val += wt * img[i, col]
                    mask += wt
            out[i, j] = val * mask
    return out


def test_shear_matches_a_bilinear_zero_fill_reference_including_the_borders() -> None:
    rng = np.random.default_rng(3)
    img = rng.uniform(0.5, 1.5, size=(7, 8))
    for shear in (3.0, 9.0):
        out = affine_shift(torch.tensor(img, dtype=torch.float32)[None, None], 0.0, shear)[0, 0]
        assert_close_finite(out.double().numpy(), _shear_reference(img, shear), rtol=0, atol=1e-5)


def test_rotation_then_shear_of_a_paper_group() -> None:
    """Group 1 of the paper: 180° clockwise, then 6° shear; the rotation is an index flip of both axes."""
    rng = np.random.default_rng(4)
    img = rng.uniform(0.5, 1.5, size=(6, 6))
    out = FeatureShift().transform(torch.tensor(img, dtype=torch.float32)[None, None], 1)[0, 0]
    assert_close_finite(out.double().numpy(), _shear_reference(img[::-1, ::-1], 6.0), rtol=0, atol=1e-5)


def test_rotation_of_a_2d_and_a_3d_tensor_turns_the_last_two_axes() -> None:
    img = torch.arange(6.0).reshape(2, 3)  # [[0, 1, 2], [3, 4, 5]]
    clockwise = torch.tensor([[3.0, 0.0], [4.0, 1.0], [5.0, 2.0]])
    assert torch.equal(affine_shift(img, 90.0, 0.0), clockwise)
    assert torch.equal(affine_shift(img[None], 90.0, 0.0), clockwise[None])
    assert torch.equal(affine_shift(img[None], -90.0, 0.0), torch.tensor([[[2.0, 5.0], [1.0, 4.0], [0.0, 3.0]]]))


def test_rotation_by_a_huge_exact_integer_multiple_of_90() -> None:
    """``90 · (2**60 + 1)``° is one quarter turn modulo a full turn (2**60 is a multiple of 4); exact integer
    arithmetic is needed to see that, since ``/ 90`` in floating point loses the ``+ 1``."""
    img = torch.arange(6.0).reshape(1, 2, 3)
    out = affine_shift(img, 90 * (2**60 + 1), 0.0)
    assert torch.equal(out, torch.tensor([[[3.0, 0.0], [4.0, 1.0], [5.0, 2.0]]]))


def test_random_assignment_is_accepted_and_draws_every_group_uniformly() -> None:
    shift = FeatureShift(assignment="random")
    assert shift.assignment == "random"
    groups = shift.assign_groups(400, np.random.default_rng(0))
    assert groups.shape == (400,) and groups.dtype == torch.long
    counts = torch.bincount(groups, minlength=4)
    assert counts.numel() == 4  # nothing outside 0..3
    assert int(groups.min()) == 0 and int(groups.max()) == 3
    assert bool((counts > 60).all())  # expected 100 each; 60 is > 4.5 standard deviations below
    with pytest.raises(ConfigError, match="assignment"):
        FeatureShift(assignment="Random")  # type: ignore[arg-type]


def test_random_assignment_with_two_groups_and_one_client() -> None:
    shift = FeatureShift(shifts=[(0.0, 0.0), (90.0, 0.0)], assignment="random")
    groups = shift.assign_groups(1, np.random.default_rng(1))
    assert groups.shape == (1,) and int(groups[0]) in (0, 1)


class _FirstClientTakesAll:
    """A base partition that gives every train and test sample to client 0."""

    def __call__(
        self, train_labels: Tensor, test_labels: Tensor, num_clients: int, rng: np.random.Generator
    ) -> tuple[IndexSets, IndexSets]:
        empty = torch.zeros(0, dtype=torch.long)
        train = [torch.arange(len(train_labels))] + [empty] * (num_clients - 1)
        test = [torch.arange(len(test_labels))] + [empty] * (num_clients - 1)
        return train, test


def test_a_given_base_partition_is_used() -> None:
    base = _FirstClientTakesAll()
    shift = FeatureShift(base=base)  # type: ignore[arg-type]
    assert shift.base is base
    train, test = shift(torch.zeros(5, dtype=torch.long), torch.zeros(2, dtype=torch.long), 3, np.random.default_rng(0))
    assert [t.tolist() for t in train] == [[0, 1, 2, 3, 4], [], []]
    assert [t.tolist() for t in test] == [[0, 1], [], []]
    assert isinstance(FeatureShift().base, IIDSplit)


def test_apply_accepts_3d_images_and_refuses_2d_rows() -> None:
    """Rows ``[N, H, W]``: client 0 (rows 0, 1) in group 0 (90° clockwise), client 1 (row 2) in group 1 (none)."""
    img = torch.arange(4.0).reshape(2, 2)  # [[0, 1], [2, 3]]
    x = torch.stack([img, img + 10, img + 20])
    ptr = torch.tensor([0, 2, 3])
    split = ClientSplit(x, torch.zeros(3, dtype=torch.long), ptr)
    fed = FederatedData(split, ClientSplit(x.clone(), split.y, ptr), 2)
    shift = FeatureShift(shifts=[(90.0, 0.0), (0.0, 0.0)])
    out = shift.apply(fed, torch.tensor([0, 1]))
    turned = torch.tensor([[2.0, 0.0], [3.0, 1.0]])
    want = torch.stack([turned, turned + 10, img + 20])
    assert torch.equal(out.train.x, want) and torch.equal(out.test.x, want)
    flat = ClientSplit(x.reshape(3, 4), split.y, ptr)
    with pytest.raises(ConfigError, match="image tensors"):
        shift.apply(FederatedData(flat, flat, 2), torch.tensor([0, 1]))


def test_rotations_move_a_known_pixel_clockwise():
    img = torch.zeros(1, 1, 6, 6)
    img[0, 0, 1, 4] = 1.0  # row 1, column 4
    n = 6
    expected = {90: (4, n - 1 - 1), 180: (n - 1 - 1, n - 1 - 4), 270: (n - 1 - 4, 1), 0: (1, 4)}
    for rotation, (r, c) in expected.items():
        out = affine_shift(img, rotation, 0.0)[0, 0]
        assert out.sum() == 1 and out[r, c] == 1, rotation


def test_clockwise_shear_tilts_a_vertical_stroke_to_the_right_at_the_top():
    n, col = 33, 16
    img = torch.zeros(1, 1, n, n)
    img[0, 0, :, col] = 1.0
    for shear in (3.0, 6.0, 9.0):
        out = affine_shift(img, 0.0, shear)[0, 0]
        rows = torch.arange(4, n - 4)  # away from the border
        centroid = (out[rows] * torch.arange(n)).sum(1) / out[rows].sum(1)
        expected = col - math.tan(math.radians(shear)) * (rows - (n - 1) / 2)
        assert_close_finite(centroid, expected.float(), rtol=0, atol=0.05)


def test_feature_shift_applies_each_clients_group_to_its_train_and_test_images():
    img = torch.zeros(1, 1, 9, 9)
    img[0, 0, 1:7, 2] = 1.0
    img[0, 0, 6, 2:6] = 1.0  # an "L"
    x = img.repeat(8, 1, 1, 1)
    ptr = torch.tensor([0, 2, 4, 6, 8])
    split = ClientSplit(x, torch.zeros(8, dtype=torch.long), ptr)
    fed = FederatedData(split, ClientSplit(x.clone(), split.y, ptr), 10)
    shift = FeatureShift()
    groups = shift.assign_groups(4, np.random.default_rng(0))
    assert sorted(groups.tolist()) == [0, 1, 2, 3]  # balanced
    out = shift.apply(fed, groups)
    paper = {0: (90, 3), 1: (180, 6), 2: (270, 9), 3: (0, 0)}
    for c, g in enumerate(groups.tolist()):
        rotation, shear = paper[g]
        want = torch.rot90(img, -rotation // 90, dims=(2, 3))
        if shear:
            want = affine_shift(want, 0.0, shear)
        for split_ in (out.train, out.test):
            xc, _ = split_.client(c)
            assert_close_finite(xc, want.expand(2, 1, 9, 9))
    assert torch.equal(out.extras["shift_group"], groups)
