"""Tower values for tests, and comparing arrays: Hypothesis strategies, ULPs, ``assert_close``.

:func:`tower_values` draws one array per tower (shapes that trip chunking code,
every supported dtype, magnitudes that cannot overflow, mantissas full enough that
summation order shows); :func:`assert_close` compares with a tolerance and reports
the worst absolute error and ULP distance; :func:`ulp_distance` counts representable
values between two arrays.

Example:
    >>> @given(tower_values(4, dtypes=["float32"]))   # doctest: +SKIP
    ... def test_mine(case): n, arrays = case
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from towers.allreduce.machinery.base import DTYPES

__all__ = [
    "Closeness",
    "assert_close",
    "is_float",
    "tower_shapes",
    "tower_values",
    "ulp_distance",
]

_PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 101)
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}
_READABLE = ("float32", "float64", "int32", "int64", "float16", "bfloat16")


def is_float(dtype: np.dtype) -> bool:
    """True for NumPy float dtypes, ml_dtypes' bfloat16 included (its kind is "V")."""
    return dtype.kind == "f" or dtype.name == "bfloat16"


# -- comparisons --------------------------------------------------------------------------------


def ulp_distance(a: Any, b: Any) -> np.ndarray:
    """How many representable values of ``a``'s dtype lie between ``a`` and ``b``, element-wise.

    ``b`` is first rounded to ``a``'s dtype; distances are counted on that dtype's bit
    patterns (float16, bfloat16, float32, float64), so ``+0`` and ``-0`` are 0 apart and
    the largest finite float is 1 from infinity. Integers give ``|a - b|``. Two NaNs
    are 0 apart, a NaN and a number the maximum uint64.

    Returns:
        A ``uint64`` array of ``a``'s broadcast shape.

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


def _worst(values: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(values)), values.shape))


def _mismatch_text(
    actual: np.ndarray, expected: np.ndarray, err: np.ndarray, ulps: np.ndarray, bad: np.ndarray
) -> str:
    i = _worst(np.where(bad, err, -1.0))
    return (
        f"{int(bad.sum())} of {bad.size} elements differ; worst at index {i}: got "
        f"{actual[i].item()!r}, expected {expected[i].item()!r} (abs error {err[i]:.3g}, "
        f"{int(ulps[i])} ULP); max abs error {float(err.max()):.3g}, max {int(ulps.max())} ULP"
    )


def assert_close(
    actual: Any,
    expected: Any,
    *,
    atol: float | np.ndarray = 0.0,
    rtol: float = 0.0,
    ulps: int | None = None,
    what: str = "",
) -> Closeness:
    """Assert ``actual`` matches ``expected`` element-wise; report abs error and ULPs if not.

    An element passes when ``|actual - expected| <= atol + rtol·|expected|``, or, when
    ``ulps`` is given, when it is at most ``ulps`` ULPs away (counted in ``actual``'s
    dtype). The defaults demand exact equality. NaNs must sit at the same places.

    Args:
        actual: the array under test (its dtype decides what a ULP is).
        expected: the reference, e.g. a float64 reduction.
        atol: absolute tolerance, a number or an array broadcastable to the shape.
        rtol: relative tolerance.
        ulps: alternative tolerance in units in the last place.
        what: names the value in the message ("output 2").

    Returns:
        The :class:`Closeness` (max abs error, max ULP distance).

    Raises:
        AssertionError: shapes differ, or some element is outside the tolerance.

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
        raise AssertionError(label + _mismatch_text(a, e, err, dist, ~ok))
    return Closeness(float(err.max()), int(dist.max()))


# -- strategies ---------------------------------------------------------------------------------


def tower_shapes() -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes that trip chunking code: ``()``, ``(0,)``, small sizes, primes, 2-D.

    Most sizes are not divisible by the tower count, so padding paths run. Shrinks
    towards ``()``.
    """
    return st.one_of(
        st.just(()),
        st.tuples(st.integers(0, 12)),
        st.tuples(st.sampled_from(_PRIMES)),
        st.tuples(st.integers(1, 4), st.integers(0, 6)),
    )


def _np_dtype(dtype: tf.DType) -> np.dtype:
    return np.dtype(dtype.as_numpy_dtype)


def _full_mantissa(dtype: tf.DType, top: int) -> st.SearchStrategy[float]:
    """``±m·2^e`` in [1, 2^13) with every mantissa bit drawn.

    Magnitudes within a few binary orders of each other, with random low bits, make
    nearly every sum depend on its order: a drifting replica cannot hide.
    """
    bits = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}[dtype.name]
    return st.builds(
        lambda sign, m, e: sign * math.ldexp(m, e - bits + 1),
        st.sampled_from([1, -1]),
        st.integers(2 ** (bits - 1), 2**bits - 1),
        st.integers(0, min(top, 12)),
    )


def _elements(dtype: tf.DType, max_towers: int, dense: bool) -> st.SearchStrategy[Any]:
    """Values whose sum over ``max_towers`` towers cannot overflow ``dtype``."""
    if dtype.is_integer:
        bound = 2**20 if dtype.size == 4 else 2**40
        return st.integers(-bound, bound)
    # A power of two, so the bound itself is representable at every width.
    top = math.floor(math.log2(float(dtype.max) / (4 * max_towers)))
    if dense:
        return _full_mantissa(dtype, top)
    width: Literal[16, 32, 64] = (
        16 if dtype.name == "float16" else 64 if dtype == tf.float64 else 32
    )
    return st.floats(  # bfloat16 draws float32 values, then casts
        -(2.0**top),
        2.0**top,
        width=width,
        allow_nan=False,
        allow_infinity=False,
        allow_subnormal=False,
    )


def _arrays(
    dtype: tf.DType, shape: tuple[int, ...], max_towers: int, dense: bool
) -> st.SearchStrategy[Any]:
    target = _np_dtype(dtype)
    drawn = target if target.name != "bfloat16" else np.dtype(np.float32)
    arrays = hnp.arrays(drawn, shape, elements=_elements(dtype, max_towers, dense))
    return arrays if drawn == target else arrays.map(lambda a: a.astype(target))


@st.composite
def tower_values(
    draw: st.DrawFn,
    max_towers: int = 8,
    dtypes: Sequence[Any] = DTYPES,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[tuple[int, ...]] | None = None,
    *,
    min_towers: int = 1,
) -> tuple[int, list[np.ndarray]]:
    """``(n, arrays)``: min_towers..max_towers towers, one array each, one shape and dtype.

    Magnitudes are bounded per dtype so that no sum over ``max_towers`` towers
    overflows; integers stay within 2^20 (int32) or 2^40 (int64); no NaN, infinity
    or subnormal is drawn. About half the examples are *dense*: every value has all
    its mantissa bits drawn and a magnitude in [1, 2^13), so that summation order
    shows in the result (plain Hypothesis floats favour round numbers and extremes,
    where one value swamps the rest). bfloat16 arrays are ``ml_dtypes.bfloat16``.

    Args:
        max_towers: the largest tower count.
        dtypes: TensorFlow or NumPy dtypes (or names) to draw from.
        shapes: a strategy or a list of shapes (default :func:`tower_shapes`).
        min_towers: the smallest tower count (``min_towers=max_towers`` fixes it).

    Example:
        >>> @given(tower_values(4, dtypes=["float32"]))   # doctest: +SKIP
        ... def test_mine(case): n, arrays = case
    """
    n = draw(st.integers(min_towers, max_towers))
    # Shrinking moves towards the first dtype: put the most readable one there.
    ordered = sorted({tf.as_dtype(d) for d in dtypes}, key=lambda d: _READABLE.index(d.name))
    dtype = draw(st.sampled_from(ordered))
    if shapes is None:
        shapes = tower_shapes()
    elif not isinstance(shapes, st.SearchStrategy):
        shapes = st.sampled_from([tuple(s) for s in shapes])
    shape = draw(shapes)
    dense = draw(st.booleans())  # shrinks to False: plain Hypothesis floats
    return n, [draw(_arrays(dtype, shape, max_towers, dense)) for _ in range(n)]
