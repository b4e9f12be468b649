"""The comparison helper refuses NaN, Inf and empty inputs, which ``numpy.testing.assert_allclose`` accepts;
numpy's RuntimeWarnings (overflow, invalid value, division by zero) are errors under this suite's config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.asserts import assert_close_finite, assert_params_close_finite


def test_plain_assert_allclose_accepts_nan_on_both_sides():
    """Why the helper exists: this passes although nothing was compared."""
    np.testing.assert_allclose(np.full(3, np.nan), np.full(3, np.nan))
    assert torch.allclose(torch.zeros(0), torch.ones(0))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("side", ["actual", "expected", "both"])
def test_fails_on_non_finite(bad, side):
    good = np.array([1.0, 2.0, 3.0])
    with_bad = good.copy()
    with_bad[1] = bad
    actual = with_bad if side in ("actual", "both") else good
    expected = with_bad if side in ("expected", "both") else good
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_finite(actual, expected)


def test_fails_on_nan_in_torch_tensors_and_scalars():
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_finite(torch.full((2, 2), float("nan")), torch.full((2, 2), float("nan")), atol=1.0)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_finite(float("nan"), float("nan"))


def test_fails_on_empty_inputs():
    with pytest.raises(AssertionError, match="empty"):
        assert_close_finite(np.zeros(0), np.zeros(0))
    with pytest.raises(AssertionError, match="empty"):
        assert_close_finite(torch.zeros(2, 0), torch.zeros(2, 0))
    with pytest.raises(AssertionError, match="no parameter names"):
        assert_params_close_finite({}, {})


def test_compares_values_and_shapes():
    assert_close_finite(torch.tensor([1.0, 2.0]), np.array([1.0, 2.0 + 1e-9]))
    assert_close_finite(torch.ones(2, 3, dtype=torch.float64), 1.0)  # a scalar broadcasts
    with pytest.raises(AssertionError):
        assert_close_finite(np.array([1.0, 2.0]), np.array([1.0, 2.1]))
    with pytest.raises(AssertionError, match="shape"):
        assert_close_finite(np.ones(3), np.ones(4))
    with pytest.raises(AssertionError):  # explicit tolerances are used
        assert_close_finite(np.array([1.0]), np.array([1.001]), rtol=1e-4, atol=0.0)
    assert_close_finite(np.array([1.0]), np.array([1.001]), rtol=1e-2, atol=0.0)
    with pytest.raises(AssertionError, match="missing"):
        assert_params_close_finite({"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_float32_defaults_follow_torch():
    x = torch.ones(4)
    assert_close_finite(x, x + 5e-6)  # within torch's float32 atol 1e-5
    with pytest.raises(AssertionError):
        assert_close_finite(x.double(), x.double() + 5e-6)  # float64: atol 1e-7


@pytest.mark.parametrize(
    "op",
    [
        lambda: np.exp(np.array([1000.0])),  # overflow
        lambda: np.array([0.0]) / np.array([0.0]),  # invalid value
        lambda: np.array([1.0]) / np.array([0.0]),  # divide by zero
        lambda: np.mean(np.zeros(0)),  # mean of an empty slice
    ],
)
def test_numpy_runtime_warnings_are_errors(op):
    """``pyproject.toml`` turns RuntimeWarning into an error for the whole suite."""
    with pytest.raises(RuntimeWarning):
        op()
