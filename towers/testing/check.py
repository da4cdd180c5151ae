"""Check any all-reduce against the contract with Hypothesis, and report what broke.

:func:`check_all_reduce` draws tower counts, shapes (``()``, ``(0,)``, primes, sizes
no tower count divides), dtypes and ops, runs the algorithm eagerly on logical
devices and checks every output:

1. **Value.** Within ``γ_k·Σ|x_i|`` of the exact sum, ``γ_k = k·u/(1 − k·u)`` with
   ``u`` = 2^-24 (float32), 2^-53 (float64), 2^-11 (float16), 2^-8 (bfloat16) and
   ``k = n − 1``: in *any* summation tree of n terms an element passes through at
   most n − 1 additions, each a factor ``(1 + δ)``, ``|δ| ≤ u`` (Higham, *Accuracy
   and Stability of Numerical Algorithms*, §4.2), so every correct algorithm meets
   it. ``mean`` allows two more roundings (``γ_{k+2}·Σ|x_i|/n``: a division, or a
   multiply by a rounded ``1/n``, which is what grappler makes of it). Integer sums,
   ``max`` and ``min`` must be exact. An algorithm (or its module) with a
   ``summation_depth(n)`` tightens ``k`` to its depth. A few smallest normals are
   allowed too: TensorFlow's CPU kernels flush subnormals to zero.
2. **Placement.** Output i lives on input i's device.
3. **Agreement.** All outputs are bitwise identical (replicas must not drift).
4. **Replay** (``replay=True``): outputs bitwise equal to
   :func:`towers.testing.replay.replay` of the algorithm's graph.
5. **Bytes.** When the algorithm moved data with ``send``, the bytes each tower
   sent equal ``bytes_sent(n, nbytes, itemsize)`` from the algorithm or its module.

A wrong algorithm never raises: the :class:`CheckReport` says what failed, on the
smallest example Hypothesis could shrink to.

Example:
    >>> report = check_all_reduce(naive)          # doctest: +SKIP
    >>> assert report.ok, report
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from towers.allreduce.base import DTYPES, OPS, AllReduce
from towers.allreduce.primitives import Recorder, record
from towers.devices import canonical_device

__all__ = [
    "DEFAULT_EXAMPLES",
    "CheckReport",
    "Closeness",
    "assert_close",
    "check_all_reduce",
    "formula_for",
    "tower_shapes",
    "tower_values",
    "ulp_distance",
    "unit_roundoff",
]

DEFAULT_EXAMPLES = 20
_PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 101)
_BITS = {2: np.int16, 4: np.int32, 8: np.int64}
_READABLE = ("float32", "float64", "int32", "int64", "float16", "bfloat16")
_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def unit_roundoff(dtype: Any) -> float:
    """``u`` of a float dtype (half the gap above 1.0); 0 for integers (they are exact)."""
    dtype = tf.as_dtype(dtype)
    return 0.0 if dtype.is_integer else _ROUNDOFF[dtype.name]


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype.name == "bfloat16"  # ml_dtypes' bfloat16 has kind "V"


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
    if not _is_float(a.dtype):
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
    if not _is_float(actual.dtype):
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


class _Case(NamedTuple):
    n: int
    arrays: list[np.ndarray]
    op: str


@st.composite
def _cases(
    draw: st.DrawFn, n: int, dtypes: Sequence[tf.DType], ops: Sequence[str], shapes: Any
) -> _Case:
    """Examples with exactly ``n`` towers."""
    _, arrays = draw(tower_values(n, dtypes, shapes, min_towers=n))
    is_int = not _is_float(arrays[0].dtype)
    return _Case(n, arrays, draw(st.sampled_from([o for o in ops if not (is_int and o == "mean")])))


# -- the reference and the bound ----------------------------------------------------------------


def formula_for(fn: Any, name: str) -> Callable[..., Any] | None:
    """An algorithm's formula ``name`` (``"bytes_sent"``, ``"summation_depth"``, …), or None.

    ``fn.<name>``, else its module's ``<name>`` with extra parameters read off ``fn``:
    ``ring(subchunks=2)`` carries ``subchunks``; the module's ``bytes_sent(n, nbytes,
    itemsize, subchunks=1)`` is then called with ``subchunks=2``. An int attribute
    becomes a formula returning it.

    Example:
        >>> formula_for(ring(subchunks=2), "bytes_sent")(4, 64, 4)   # doctest: +SKIP
    """
    attr = getattr(fn, name, None)
    if callable(attr) or isinstance(attr, int):
        return attr if callable(attr) else (lambda *args: attr)
    module_fn = getattr(sys.modules.get(getattr(fn, "__module__", "") or ""), name, None)
    if not callable(module_fn):
        return None
    try:
        params = inspect.signature(module_fn).parameters
    except (TypeError, ValueError):
        return module_fn
    extra = {
        p: getattr(fn, p) for p in params if p not in ("n", "nbytes", "itemsize") and hasattr(fn, p)
    }
    return lambda *args: module_fn(*args, **extra)


def _gamma(k: int, u: float) -> float:
    return math.inf if k * u >= 1 else k * u / (1 - k * u)


def _reference(arrays: list[np.ndarray], op: str, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact reduction (rounded once to float64, or exact in its dtype) and the tolerance."""
    stack = np.stack(arrays)
    if op in ("max", "min"):
        exact = np.max(stack, axis=0) if op == "max" else np.min(stack, axis=0)
        return exact, np.zeros(exact.shape)
    if not _is_float(stack.dtype):
        exact_int = np.asarray(np.sum(stack.astype(object), axis=0), dtype=stack.dtype)
        return exact_int, np.zeros(exact_int.shape)
    wide = stack.astype(np.float64).reshape(len(arrays), -1)
    sums = np.array([math.fsum(column) for column in wide.T], np.float64)
    magnitude = np.sum(np.abs(wide), axis=0)
    n, u = len(arrays), unit_roundoff(stack.dtype)
    # mean: a division, or a multiply by a rounded 1/n (grappler's rewrite): two more roundings.
    k = depth + 2 * (op == "mean")
    smallest = np.finfo(np.float32 if stack.dtype.name == "bfloat16" else stack.dtype).tiny
    flushed = (k + 1) * float(smallest)  # each rounding may flush a subnormal to zero
    tol = _gamma(k, u) * magnitude + 2.0**-52 * magnitude + flushed  # 2^-52: float64 reference
    if op == "mean":
        sums, tol = sums / n, tol / n + flushed
    shape = arrays[0].shape
    return sums.reshape(shape), tol.reshape(shape)


# -- checking one example -----------------------------------------------------------------------


def _place(arrays: list[np.ndarray], devices: Sequence[str]) -> list[tf.Tensor]:
    values = []
    for array, device in zip(arrays, devices, strict=True):
        with tf.device(device):
            values.append(tf.identity(tf.constant(array)))
    return values


def _check_outputs(outs: Any, case: _Case, devices: Sequence[str]) -> list[str]:
    """Count, type, shape, dtype and placement of the outputs (check 2)."""
    if not isinstance(outs, (list, tuple)) or len(outs) != case.n:
        count = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
        return [f"returned {count} outputs for {case.n} towers"]
    want_dtype, want_shape = tf.as_dtype(case.arrays[0].dtype), case.arrays[0].shape
    failures = []
    for i, out in enumerate(outs):
        if not isinstance(out, (tf.Tensor, tf.Variable)):
            failures.append(f"output {i} is a {type(out).__name__}, not a tf.Tensor")
        elif out.dtype != want_dtype or tuple(out.shape) != want_shape:
            failures.append(
                f"output {i} is {out.dtype.name}{list(out.shape)}, "
                f"expected {want_dtype.name}{list(want_shape)}"
            )
        elif canonical_device(out.device) != canonical_device(devices[i]):
            failures.append(
                f"output {i} is on {canonical_device(out.device)}, but input {i} is on "
                f"{canonical_device(devices[i])}"
            )
    return failures


def _bitwise(actual: np.ndarray, expected: np.ndarray, what: str) -> str | None:
    """None when bitwise equal; else what differs (values, or only signs of zero)."""
    if actual.tobytes() == np.asarray(expected).tobytes():
        return None
    try:
        assert_close(actual, expected, what=what)
    except AssertionError as err:
        return str(err)
    return f"{what}: equal values but different bits (signed zeros or NaN payloads)"


def _check_values(results: list[np.ndarray], case: _Case, depth: int) -> list[str]:
    """Check 1 (the bound) and check 3 (bitwise agreement)."""
    expected, tol = _reference(case.arrays, case.op, depth)
    failures = []
    for i, result in enumerate(results):
        try:
            assert_close(result, expected, atol=tol, what=f"output {i}")
        except AssertionError as err:
            bound = f"bound γ_k·Σ|x| with summation depth {depth}" if tol.any() else "exact"
            failures.append(f"{err} [{bound}]")
    for i, result in enumerate(results[1:], start=1):
        diff = _bitwise(result, results[0], f"output {i} vs output 0")
        if diff:
            failures.append(f"outputs are not bitwise identical: {diff}")
    return failures


def _check_bytes(fn: Any, rec: Recorder, case: _Case, devices: Sequence[str]) -> list[str]:
    """Check 5: bytes each tower sent against the algorithm's ``bytes_sent`` formula."""
    formula = formula_for(fn, "bytes_sent")
    if formula is None or not rec.transfers:
        return []
    itemsize = case.arrays[0].dtype.itemsize
    nbytes = case.arrays[0].size * itemsize
    expected = formula(case.n, nbytes, itemsize)
    expected = (
        [int(expected)] * case.n if isinstance(expected, (int, np.integer)) else list(expected)
    )
    sent = rec.bytes_sent()
    got = [sent.get(canonical_device(d), 0) for d in devices[: case.n]]
    if got != expected:
        return [
            f"bytes sent per tower {got} differ from bytes_sent(n={case.n}, nbytes={nbytes}, "
            f"itemsize={itemsize}) = {expected}"
        ]
    return []


def _check_replay(
    fn: Any, results: list[np.ndarray], case: _Case, devices: Sequence[str]
) -> list[str]:
    """Check 4: bitwise equal to the NumPy replay of the algorithm's graph."""
    from towers.testing.replay import ReplayError, replay

    try:
        replayed = replay(fn, case.arrays, case.op, devices=devices[: case.n])
    except ReplayError:
        return []  # opaque or unsupported ops: nothing to compare against
    except Exception as err:
        return [f"tracing it in a tf.function for replay raised {type(err).__name__}: {err}"]
    diffs = [
        _bitwise(result, np.asarray(again), f"output {i} vs its NumPy replay")
        for i, (result, again) in enumerate(zip(results, replayed, strict=False))
    ]
    return [d for d in diffs if d]


def _check_case(fn: Any, case: _Case, devices: Sequence[str], replay: bool) -> list[str]:
    placed = list(devices[: case.n])
    try:
        values = _place(case.arrays, placed)
        with record() as rec:
            outs = fn(values, op=case.op)
    except Exception as err:
        return [f"raised {type(err).__name__}: {err}"]
    failures = _check_outputs(outs, case, placed)
    if failures:
        return failures
    results = [np.asarray(out.numpy()) for out in outs]
    depth_fn = formula_for(fn, "summation_depth")
    try:
        depth = max(case.n - 1, 0) if depth_fn is None else int(depth_fn(case.n))
        failures = _check_values(results, case, depth) + _check_bytes(fn, rec, case, placed)
    except Exception as err:  # a formula that fails is the algorithm's failure too
        return [f"a summation_depth/bytes_sent formula raised {type(err).__name__}: {err}"]
    return failures + (_check_replay(fn, results, case, placed) if replay else [])


def _show(array: np.ndarray) -> str:
    shown = array.astype(np.float32) if array.dtype.name == "bfloat16" else array
    return np.array2string(shown, threshold=24, floatmode="unique", separator=", ")


def _describe(case: _Case, devices: Sequence[str]) -> str:
    first = case.arrays[0]
    lines = [f"n={case.n} towers, shape={first.shape}, dtype={first.dtype.name}, op={case.op!r}"]
    lines += [
        f"  values[{i}] on {canonical_device(devices[i])}: {_show(a)}"
        for i, a in enumerate(case.arrays)
    ]
    return "\n".join(lines)


# -- the driver and its report ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, repr=False)
class CheckReport:
    """What :func:`check_all_reduce` found. ``bool(report)`` is ``report.ok``.

    Its ``str`` (and ``repr``, so ``assert report.ok, report`` reads well) is the verdict.
    """

    algorithm: str
    ok: bool
    examples: int
    failures: tuple[str, ...] = ()
    example: str | None = None
    notes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'}: {self.algorithm} ({self.examples} examples run)"
        lines = [head, *(f"  note: {note}" for note in self.notes)]
        if self.example is not None:
            lines += ["Smallest failing example:", self.example]
        if self.failures:
            lines += ["Failures:", *(f"  - {f}" for f in self.failures)]
        return "\n".join(lines)

    __repr__ = __str__


class _Failed(AssertionError):
    def __init__(self, example: str, failures: list[str]) -> None:
        super().__init__(example + "\n" + "\n".join(failures))
        self.example, self.failures = example, failures


def _devices(devices: Sequence[str] | None, max_towers: int) -> list[str]:
    if devices is None:
        from towers.devices import local_devices

        devices = local_devices()
    if len(devices) < max_towers:
        raise ValueError(
            f"max_towers={max_towers} but only {len(devices)} devices: call "
            f"towers.simulate_devices({max_towers}) first thing, or lower max_towers"
        )
    return list(devices)


def _notes(fn: Any, replay: bool) -> tuple[str, ...]:
    notes = []
    if formula_for(fn, "bytes_sent") is None:
        notes.append("bytes not checked: no bytes_sent(n, nbytes, itemsize) on it or its module")
    if formula_for(fn, "summation_depth") is None:
        notes.append("bound uses depth n-1: no summation_depth(n) on it or its module")
    if not replay:
        notes.append("replay not checked (replay=True compares with the NumPy replay)")
    return tuple(notes)


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        report_multiple_bugs=False,
        print_blob=False,
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )


class _Options(NamedTuple):
    devices: list[str]
    replay: bool
    seed: int | None


def _search(
    algorithm: Any, n: int, examples: int, cases: st.SearchStrategy[_Case], options: _Options
) -> tuple[int, _Failed | None]:
    """One Hypothesis search at ``n`` towers: (examples run, the shrunk failure or None)."""
    runs = [0]
    devices, replay, seed = options

    @_settings(examples)
    @given(cases)
    def prop(case: _Case) -> None:
        runs[0] += 1
        failures = _check_case(algorithm, case, devices, replay)
        if failures:
            raise _Failed(_describe(case, devices), failures)

    try:
        (prop if seed is None else hypothesis_seed(seed + n)(prop))()
    except _Failed as failed:
        return runs[0], failed
    except Exception as err:  # Hypothesis itself gave up (a flaky algorithm, ...)
        return runs[0], _Failed(f"n={n} towers (no example kept)", [f"{type(err).__name__}: {err}"])
    return runs[0], None


def check_all_reduce(
    fn: AllReduce | str,
    *,
    max_towers: int = 8,
    dtypes: Sequence[Any] = DTYPES,
    ops: Sequence[str] = OPS,
    shapes: st.SearchStrategy[tuple[int, ...]] | Sequence[tuple[int, ...]] | None = None,
    max_examples: int | None = None,
    devices: Sequence[str] | None = None,
    seed: int | None = 0,
    replay: bool = False,
    tower_counts: Sequence[int] | None = None,
) -> CheckReport:
    """Run Hypothesis over towers, shapes, dtypes and ops; report every broken promise.

    Every tower count from 1 to ``max_towers`` gets its own search, in ascending
    order, so each count is exercised and the first failure found has the fewest
    towers; Hypothesis then shrinks its shape, dtype, op and values.

    Args:
        fn: an all-reduce callable, or a registry name (``"naive"``).
        max_towers: the largest tower count.
        dtypes: dtypes to draw (default: every dtype the contract supports).
        ops: ops to draw (``"mean"`` is skipped for integer dtypes).
        shapes: shapes to draw (default :func:`tower_shapes`).
        max_examples: examples in all (default :data:`DEFAULT_EXAMPLES`, 20), spread
            over the tower counts, at least 2 each (the first is all zeros).
        devices: the devices to place towers on (default ``towers.local_devices()``).
        seed: Hypothesis seed, for reproducible runs; ``None`` draws afresh each run.
        replay: also demand bitwise equality with the NumPy replay (slower: one trace
            per example; skipped for algorithms replay cannot follow).
        tower_counts: the counts to check (default ``1..max_towers``), e.g. ``[2, 4, 8]``
            for an algorithm that needs groups of two.

    Returns:
        A :class:`CheckReport`: ``ok``, the failures and the smallest failing example,
        printable as a verdict.

    Raises:
        ValueError: fewer devices than ``max_towers``, tower counts outside
            ``1..max_towers``, or no op applies to any dtype.
            A wrong algorithm never raises; its report says what failed.

    Example:
        >>> report = check_all_reduce("naive", max_towers=4)   # doctest: +SKIP
        >>> print(report)                                      # doctest: +SKIP
        PASS: naive (20 examples run)
    """
    from towers.allreduce import get

    algorithm = get(fn)
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))
    options = _Options(_devices(devices, max_towers), replay, seed)
    dtypes = [tf.as_dtype(d) for d in dtypes]
    dtypes = [d for d in dtypes if d.is_floating or any(o != "mean" for o in ops)]
    if not dtypes or not ops:
        raise ValueError(f"no op in {list(ops)} applies to the dtypes asked for")
    counts = sorted(set(tower_counts or range(1, max_towers + 1)))
    if counts[0] < 1 or counts[-1] > max_towers:
        raise ValueError(f"tower_counts must lie in 1..max_towers={max_towers}, got {counts}")
    per_count = max(2, -(-(max_examples or DEFAULT_EXAMPLES) // len(counts)))
    notes, total = _notes(algorithm, replay), 0
    for n in counts:
        runs, failed = _search(algorithm, n, per_count, _cases(n, dtypes, ops, shapes), options)
        total += runs
        if failed is not None:
            return CheckReport(name, False, total, tuple(failed.failures), failed.example, notes)
    return CheckReport(name, True, total, notes=notes)
