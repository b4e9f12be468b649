"""Test helpers shared by the numerical reference tests.

``numpy.testing.assert_allclose`` treats NaN as equal to NaN (``equal_nan=True`` by default) and every
``allclose`` passes on two empty arrays, so a reference test whose numbers diverged, or whose selection came
out empty, can pass while asserting nothing. :func:`assert_close_finite` refuses both before it compares.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _low_precision(*arrays: np.ndarray) -> bool:
    return any(a.dtype in (np.float32, np.float16) for a in arrays)


def assert_close_finite(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    msg: str = "",
) -> None:
    """``|actual − expected| ≤ atol + rtol·|expected|`` elementwise, after checking that both sides are
    non-empty and entirely finite and that ``expected`` broadcasts to ``actual``'s shape.

    Accepts torch tensors (any device, with or without grad), numpy arrays and Python numbers. Default
    tolerances follow ``torch.testing.assert_close``: rtol 1.3e-6 / atol 1e-5 when either side is float32 or
    lower, else rtol 1e-7 / atol 1e-7. Pass the tolerances of the comparison you replace explicitly.
    """
    a, e = _as_array(actual), _as_array(expected)
    where = f" ({msg})" if msg else ""
    if a.size == 0 or e.size == 0:
        raise AssertionError(f"empty comparison{where}: actual shape {a.shape}, expected shape {e.shape}")
    for side, arr in (("actual", a), ("expected", e)):
        if not np.issubdtype(arr.dtype, np.number) and arr.dtype != np.bool_:
            raise AssertionError(f"{side} is not numeric{where}: dtype {arr.dtype}")
        bad = ~np.isfinite(arr.astype(np.float64) if arr.dtype == np.bool_ else arr)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0]) if arr.ndim else ()
            raise AssertionError(
                f"{side} has {int(bad.sum())} non-finite of {arr.size} entries{where}; first at {first}: {arr[first]}"
            )
    try:
        e = np.broadcast_to(e, a.shape)
    except ValueError:
        raise AssertionError(f"shape mismatch{where}: actual {a.shape}, expected {e.shape}") from None
    low = _low_precision(a, e)
    rtol = (1.3e-6 if low else 1e-7) if rtol is None else rtol
    atol = (1e-5 if low else 1e-7) if atol is None else atol
    np.testing.assert_allclose(
        a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=False, err_msg=msg
    )


def assert_params_close_finite(
    actual: dict[str, Any],
    expected: dict[str, Any],
    names: Iterable[str] | None = None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """:func:`assert_close_finite` on every name of ``names`` (default: ``expected``'s); ``names`` must not be
    empty and each name must be on both sides."""
    names = list(expected if names is None else names)
    if not names:
        raise AssertionError("no parameter names to compare")
    for n in names:
        if n not in actual or n not in expected:
            raise AssertionError(f"{n!r} missing: actual has {sorted(actual)}, expected has {sorted(expected)}")
        assert_close_finite(actual[n], expected[n], rtol=rtol, atol=atol, msg=n)
