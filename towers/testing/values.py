"""Tower values for tests, and comparing arrays: Hypothesis strategies, ULPs, ``assert_close``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from towers.allreduce.machinery.base import DTYPES

__all__ = ["Closeness", "assert_close", "assert_weights_close", "is_float", "tower_values",
           "ulp_distance", "weight_report"]

_PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 101)
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}
_READABLE = ("float32", "float64", "int32", "int64", "float16", "bfloat16")


def is_float(dtype: np.dtype) -> bool:
    """True for NumPy float dtypes, ml_dtypes' bfloat16 included (its kind is "V")."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


def ulp_distance(a: Any, b: Any) -> np.ndarray:
    """How many representable values of ``a``'s dtype lie between ``a`` and ``b``, element-wise.

    Counted on the bit patterns of ``a``'s dtype (``b`` rounded to it): ``+0`` and ``-0``
    are 0 apart, two NaNs 0, a NaN and a number the maximum uint64; integers ``|a - b|``.

    Example:
        >>> ulp_distance(np.float32(1), np.float32(1) + np.float32(2**-23))
        array(1, dtype=uint64)
    """
    a = np.asarray(a)
    b = np.asarray(b).astype(a.dtype)
    if not is_float(a.dtype):
        wide_a, wide_b = a.astype(object), b.astype(object)
        return np.asarray(np.abs(wide_a - wide_b), dtype=np.uint64)
    keys = []
    for x in (a, b):
        bits = np.atleast_1d(x).view(_BITS[x.dtype.itemsize]).astype(np.int64)
        magnitude = bits & np.int64(2 ** (8 * x.dtype.itemsize - 1) - 1)
        keys.append(np.where(bits < 0, -magnitude, bits).reshape(x.shape))  # onto a number line
    ka, kb = np.broadcast_arrays(*keys)
    same = (ka < 0) == (kb < 0)
    with np.errstate(over="ignore"):
        far = np.abs(ka).astype(np.uint64) + np.abs(kb).astype(np.uint64)
        near = np.abs(ka - np.where(same, kb, 0)).astype(np.uint64)
    out = np.where(same, near, far)
    nan_a, nan_b = np.isnan(a.astype(np.float64)), np.isnan(b.astype(np.float64))
    out = np.where(nan_a | nan_b, np.iinfo(np.uint64).max, out)
    return np.asarray(np.where(nan_a & nan_b, 0, out), dtype=np.uint64)


class Closeness(NamedTuple):
    """How far ``actual`` is from ``expected``: worst absolute error and worst ULP distance."""

    max_abs_error: float
    max_ulps: int


def _errors(actual: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ulps = ulp_distance(actual, expected)
    if not is_float(actual.dtype):
        return ulps.astype(np.float64), ulps
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    same = (actual.astype(np.float64) == expected.astype(np.float64)) | (ulps == 0)
    return np.where(same, 0.0, np.nan_to_num(err, nan=np.inf)), ulps


def assert_close(actual: Any, expected: Any, *, atol: float | np.ndarray = 0.0, rtol: float = 0.0,
                 ulps: int | None = None, what: str = "") -> Closeness:  # fmt: skip
    """Assert ``actual`` matches ``expected`` element-wise; report abs error and ULPs if not.

    An element passes when ``|actual - expected| <= atol + rtol·|expected|`` (``atol`` a
    number or an array), or when it is at most ``ulps`` ULPs away in ``actual``'s dtype.
    The defaults demand exact equality; NaNs must sit at the same places. ``what`` names
    the value in the message.

    Example:
        >>> assert_close(np.float32(1.0000001), 1.0, ulps=1)
        Closeness(max_abs_error=1.1920928955078125e-07, max_ulps=1)
    """
    a, e = np.asarray(actual), np.asarray(expected)
    label = f"{what}: " if what else ""
    if a.shape != e.shape:
        raise AssertionError(f"{label}shape {a.shape} differs from expected {e.shape}")
    if a.size == 0:
        return Closeness(0.0, 0)
    err, dist = _errors(a, e)
    with np.errstate(invalid="ignore", over="ignore"):
        bound = np.asarray(atol, np.float64) + rtol * np.abs(e.astype(np.float64))
    ok = err <= np.nan_to_num(bound, nan=0.0)  # a NaN expected value needs a NaN (err 0)
    if ulps is not None:
        ok |= dist <= ulps
    if not np.all(ok):
        masked = np.where(ok, -1.0, err)
        i = tuple(int(k) for k in np.unravel_index(int(np.argmax(masked)), masked.shape))
        raise AssertionError(
            f"{label}{int((~ok).sum())} of {ok.size} elements differ; worst at index {i}: got "
            f"{a[i].item()!r}, expected {e[i].item()!r} (abs error {err[i]:.3g}, "
            f"{int(dist[i])} ULP); max abs error {float(err.max()):.3g}, max {int(dist.max())} ULP")
    return Closeness(float(err.max()), int(dist.max()))


def _full_mantissa(dtype: tf.DType, top: int) -> st.SearchStrategy[float]:
    """``±m·2^e`` in [1, 2^13) with every mantissa bit drawn: nearly every sum of such
    values depends on its order, so a drifting replica cannot hide."""
    bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[dtype.name]
    return st.builds(lambda sign, m, e: sign * math.ldexp(m, e - bits + 1),
                     st.sampled_from([1, -1]), st.integers(2 ** (bits - 1), 2**bits - 1),
                     st.integers(0, min(top, 12)))


def _elements(dtype: tf.DType, max_towers: int, dense: bool) -> st.SearchStrategy[Any]:
    """Values whose sum over ``max_towers`` towers cannot overflow ``dtype``."""
    if dtype.is_integer:
        bound = 2**20 if dtype.size == 4 else 2**40
        return st.integers(-bound, bound)
    # A power of two, so the bound itself is representable at every width.
    top = math.floor(math.log2(float(dtype.max) / (4 * max_towers)))
    if dense:
        return _full_mantissa(dtype, top)
    width: Literal[16, 32, 64] = 16 if dtype.name == "float16" else 32
    width = 64 if dtype == tf.float64 else width
    return st.floats(-(2.0**top), 2.0**top, width=width, allow_nan=False, allow_infinity=False,
                     allow_subnormal=False)  # bfloat16 draws float32 values, then casts


@st.composite
def tower_values(
    draw: st.DrawFn, max_towers: int = 8, dtypes: Sequence[Any] = DTYPES,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[tuple[int, ...]] | None = None, *,
    min_towers: int = 1,
) -> tuple[int, list[np.ndarray]]:
    """``(n, arrays)``: ``min_towers..max_towers`` towers, one array each, one shape and dtype.

    No sum overflows; no NaN, infinity or subnormal is drawn. About half the examples are
    *dense* (:func:`_full_mantissa`), so summation order shows. ``shapes``: a strategy or a
    list (default: shapes that trip chunking code, most sizes no tower count divides).
    """
    n = draw(st.integers(min_towers, max_towers))
    # Shrinking moves towards the first dtype: put the most readable one there.
    ordered = sorted({tf.as_dtype(d) for d in dtypes}, key=lambda d: _READABLE.index(d.name))
    dtype = draw(st.sampled_from(ordered))
    if shapes is None:  # shrinks to ()
        shapes = st.one_of(st.just(()), st.tuples(st.integers(0, 12)),
                           st.tuples(st.sampled_from(_PRIMES)),
                           st.tuples(st.integers(1, 4), st.integers(0, 6)))
    elif not isinstance(shapes, st.SearchStrategy):
        shapes = st.sampled_from([tuple(s) for s in shapes])
    shape = draw(shapes)
    dense = draw(st.booleans())  # shrinks to False: plain Hypothesis floats
    target = np.dtype(dtype.as_numpy_dtype)
    drawn = target if target.name != "bfloat16" else np.dtype(np.float32)
    arrays = hnp.arrays(drawn, shape, elements=_elements(dtype, max_towers, dense))
    return n, [draw(arrays).astype(target) for _ in range(n)]


def weight_report(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray],
                  names: Sequence[str] | None = None) -> list[tuple[str, float, int]]:  # fmt: skip
    """Per weight: (name, max abs error, max ULP distance)."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} weights vs {len(expected)} expected")
    names = list(names) if names is not None else [f"weight[{i}]" for i in range(len(actual))]
    rows = []
    for name, a, e in zip(names, actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            raise AssertionError(f"{name}: shape {a.shape} vs expected {e.shape}")
        err = float(np.max(np.abs(a.astype(np.float64) - e))) if a.size else 0.0
        ulps = int(np.max(ulp_distance(a, e))) if a.size else 0
        rows.append((name, err, ulps))
    return rows


def assert_weights_close(actual: Sequence[np.ndarray], expected: Sequence[np.ndarray], *,
                         atol: float | Sequence[np.ndarray] = 0.0,
                         names: Sequence[str] | None = None, what: str = "") -> None:  # fmt: skip
    """Assert every weight matches within ``atol`` (a number, or one bound array per weight);
    the message lists each weight's max abs error and ULPs: rounding, or a bug?"""
    rows = weight_report(actual, expected, names)
    bounds = atol if isinstance(atol, Sequence) else [atol] * len(rows)
    bad = []
    for (name, _, _), a, e, bound in zip(rows, actual, expected, bounds):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))
        if not np.all(diff <= np.asarray(bound)) or np.any(np.isnan(a) != np.isnan(e)):
            bad.append(name)
    if bad:
        table = "\n".join(f"  {n}: max abs err {err:.3g}, max {u} ULPs" for n, err, u in rows)
        raise AssertionError(f"{what} weights differ beyond the bound in {bad}:\n{table}")
