"""Tests of send, its recording and the chores, and the checks every algorithm test shares.

The shared part (strategies, exact reference, error bound, byte counts) belongs in
``towers/testing.py`` once that module exists; the algorithm tests import it from here.

Error bound, derived once. Each output element is a sum ``ŝ`` of the n inputs formed
by floating-point additions, each correctly rounded: ``fl(a + b) = (a + b)(1 + δ)``,
``|δ| ≤ u`` (u = 2^-11 float16, 2^-8 bfloat16, 2^-24 float32, 2^-53 float64; TF's
half-precision adds go through float32, a double rounding that is innocuous since
24 ≥ 2p + 2). An input that passes through ``d_i`` additions is multiplied by
``∏(1 + δ) = 1 + θ``, ``|θ| ≤ γ_{d_i} = d_i·u / (1 - d_i·u)`` (Higham, Accuracy and
Stability, Lemma 3.1), so ``|ŝ - s| ≤ Σ γ_{d_i}|x_i| ≤ γ_d·Σ|x_i|`` with ``d`` the
algorithm's ``summation_depth``. Additions whose result is subnormal are exact, so
the bound needs no underflow term. ``mean`` divides once more: ``fl(ŝ / n) = ŝ/n·(1+δ)``
gives ``|fl(ŝ/n) - s/n| ≤ (γ_d + u + u·γ_d)·Σ|x_i|/n ≤ γ_{d+1}·Σ|x_i|/n`` — provided
``ŝ/n`` is a normal number, which the generated values guarantee (below). The
reference ``s`` is computed exactly with ``fractions.Fraction``, so the test itself
adds no rounding. Integer sums and max/min must be exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import DEVICES
from towers.allreduce.machinery.base import OPS
from towers.allreduce.machinery.packed import pad_split, unsplit
from towers.allreduce.machinery.primitives import record, send, tick_offset
from towers.allreduce.machinery.rounding import unit_roundoff
from towers.devices import canonical_device

FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
DTYPES = (*FLOATS, tf.int32, tf.int64)
# precision p (bits, implicit one included) and the smallest normal exponent
FORMATS = {
    tf.float16: (11, -14),
    tf.bfloat16: (8, -126),
    tf.float32: (24, -126),
    tf.float64: (53, -1022),
}
# Exponent ranges: float16 values are multiples of 2^-11 (exponent >= -1), so a nonzero
# sum is >= 2^-11 and its mean >= 2^-14, the smallest normal; |x| < 2^6 keeps 8 of them
# far below float16's 65504. The wider formats take a wide range of magnitudes.
EXPONENTS = {
    tf.float16: (-1, 5),
    tf.bfloat16: (-20, 20),
    tf.float32: (-20, 20),
    tf.float64: (-20, 20),
}
SHAPES = [(), (0,), (1,), (2,), (5,), (7,), (13,), (2, 3), (3, 5), (31,), (2, 0, 3), (97,)]
PLAIN_OPS = {
    "Placeholder",
    "Const",
    "Identity",
    "Reshape",
    "Pad",
    "Split",
    "ConcatV2",
    "GatherV2",
    "StridedSlice",
    "AddV2",
    "Maximum",
    "Minimum",
    "RealDiv",
    "NoOp",
}
# (algorithm, dtype) -> largest error seen: in ULPs of the exact result, and as a share of
# the bound γ_d·Σ|x_i| (ULPs grow large where the inputs cancel; the share stays below 1)
MAX_ULPS: dict[tuple[str, str], float] = {}
MAX_SHARE_OF_BOUND: dict[tuple[str, str], float] = {}


class Error(NamedTuple):
    ulps: float
    share_of_bound: float


class Case(NamedTuple):
    n: int
    shape: tuple[int, ...]
    dtype: tf.DType
    op: str
    seed: int


@st.composite
def cases(
    draw: Any, dtype: tf.DType | None = None, op: str | None = None, max_towers: int = 8
) -> Case:
    """One all-reduce problem: towers, shape, dtype, op (mean only for floats), data seed."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    ops = OPS if dtype.is_floating else tuple(o for o in OPS if o != "mean")
    return Case(
        draw(st.integers(1, max_towers)),
        draw(st.sampled_from(SHAPES)),
        dtype,
        op or draw(st.sampled_from(ops)),
        draw(st.integers(0, 2**32 - 1)),
    )


# every dtype with every op it supports, for tests that parametrize over them
DTYPE_OPS = [(d, o) for d in DTYPES for o in OPS if d.is_floating or o != "mean"]
DTYPE_OP_IDS = [f"{d.name}-{o}" for d, o in DTYPE_OPS]


def make_arrays(case: Case) -> list[np.ndarray]:
    """Per-tower NumPy values, exactly representable in ``case.dtype``; ~10% zeros."""
    rng = np.random.default_rng(case.seed)
    out = []
    for _ in range(case.n):
        if case.dtype.is_integer:
            a = rng.integers(-1000, 1000, size=case.shape)
        else:
            lo, hi = EXPONENTS[case.dtype]
            a = rng.uniform(1, 2, case.shape) * np.exp2(rng.integers(lo, hi + 1, case.shape))
            a = a * rng.choice([-1.0, 1.0], case.shape) * (rng.uniform(size=case.shape) > 0.1)
        out.append(np.asarray(a).astype(case.dtype.as_numpy_dtype))
    return out


def place(arrays: Sequence[np.ndarray]) -> list[tf.Tensor]:
    """``arrays[i]`` as a tensor on ``DEVICES[i]``."""
    values = []
    for i, a in enumerate(arrays):
        with tf.device(DEVICES[i]):
            values.append(tf.identity(tf.constant(a)))
    return values


def gamma_exact(k: int, dtype: Any) -> Fraction:
    """γ_k of ``dtype`` as an exact fraction."""
    u = Fraction(unit_roundoff(dtype))
    return k * u / (1 - k * u)


def _ulp(v: Fraction, p: int, emin: int) -> Fraction:
    e = math.frexp(float(v))[1] - 1 if v else emin
    return Fraction(2) ** (max(e, emin) - p + 1)


def assert_matches_reference(
    outs: Sequence[Any],
    arrays: Sequence[np.ndarray],
    op: str,
    depth: int,
    *,
    mean_roundings: int = 1,
) -> Error:
    """Check every output against the exact reduction; returns the largest error seen.

    ``mean_roundings`` is how many roundings a mean adds after the sum: 1 for a division;
    2 inside a ``tf.function`` run with Grappler, which folds ``x / n`` into
    ``x · fl(1/n)``.
    """
    stack = np.stack([np.asarray(a) for a in arrays]).reshape(len(arrays), -1)
    dtype = tf.as_dtype(stack.dtype)
    flat = [np.asarray(o).reshape(-1) for o in outs]
    if op in ("max", "min") or dtype.is_integer:
        fold = {"max": np.max, "min": np.min}.get(op, np.sum)
        want = fold(stack.astype(np.float64 if dtype.is_floating else np.int64), axis=0)
        for i, f in enumerate(flat):
            np.testing.assert_array_equal(f.astype(want.dtype), want, err_msg=f"output {i}")
        return Error(0.0, 0.0)
    p, emin = FORMATS[dtype]
    n = len(arrays)
    worst, share = 0.0, 0.0
    for j in range(stack.shape[1]):
        xs = [Fraction(float(x)) for x in stack[:, j].astype(np.float64)]
        exact, mag = sum(xs, Fraction(0)), sum((abs(x) for x in xs), Fraction(0))
        bound = gamma_exact(depth, dtype) * mag
        if op == "mean":
            exact, bound = exact / n, gamma_exact(depth + mean_roundings, dtype) * mag / n
        for i, f in enumerate(flat):
            err = abs(Fraction(float(f[j].astype(np.float64))) - exact)
            assert err <= bound, f"output {i}, element {j}: error {float(err)} > {float(bound)}"
            worst = max(worst, float(err / _ulp(exact, p, emin)))
            share = max(share, float(err / bound) if bound else 0.0)
    return Error(worst, share)


def assert_outputs(
    outputs: Sequence[tf.Tensor],
    values: Sequence[tf.Tensor],
    op: str,
    depth: int,
    *,
    devices: Sequence[str] | None = None,
    mean_roundings: int = 1,
) -> Error:
    """The contract on finished outputs: one per value, on its device (``devices``, default
    the values'), same shape and dtype, bitwise identical, and within the bound."""
    devices = devices or [canonical_device(v.device) for v in values]
    assert len(outputs) == len(values), f"{len(outputs)} outputs for {len(values)} values"
    first = outputs[0].numpy().tobytes()
    for i, out in enumerate(outputs):
        assert canonical_device(out.device) == devices[i], f"output {i} on {out.device}"
        assert out.shape == values[0].shape and out.dtype == values[0].dtype, f"output {i}"
        assert out.numpy().tobytes() == first, f"output {i} differs bitwise from output 0"
    arrays = [v.numpy() for v in values]
    return assert_matches_reference(
        [o.numpy() for o in outputs], arrays, op, depth, mean_roundings=mean_roundings
    )


def check_all_reduce(
    name: str,
    algorithm: Callable[..., list[tf.Tensor]],
    case: Case,
    *,
    depth: int,
    expected_bytes: Sequence[int],
) -> list[tf.Tensor]:
    """Run ``algorithm`` eagerly on ``case`` and check everything the contract promises."""
    arrays = make_arrays(case)
    values = place(arrays)
    with record() as rec:
        outs = algorithm(values, op=case.op)
    assert len(outs) == case.n
    for i, out in enumerate(outs):
        assert canonical_device(out.device) == canonical_device(DEVICES[i]), f"output {i}"
        assert out.shape == case.shape and out.dtype == case.dtype, f"output {i}"
    raw = [o.numpy() for o in outs]
    for i, r in enumerate(raw):
        assert r.tobytes() == raw[0].tobytes(), f"output {i} differs bitwise from output 0"
    error = assert_matches_reference(raw, arrays, case.op, depth)
    key = (name, case.dtype.name)
    MAX_ULPS[key] = max(MAX_ULPS.get(key, 0.0), error.ulps)
    MAX_SHARE_OF_BOUND[key] = max(MAX_SHARE_OF_BOUND.get(key, 0.0), error.share_of_bound)
    sent = rec.bytes_sent()
    assert [sent.get(DEVICES[i], 0) for i in range(case.n)] == list(expected_bytes)
    assert set(sent) <= set(DEVICES[: case.n])
    assert all(t.tick is not None and t.chunk is not None for t in rec.transfers)
    return outs


def assert_traced_graph_is_sound(
    algorithm: Callable[..., list[tf.Tensor]], case: Case, graph_depth: int
) -> tuple[np.ndarray, np.ndarray]:
    """Trace ``algorithm`` in one ``tf.function``: plain ops, placement, agreement, the bound.

    Inside a ``tf.function`` Grappler may regroup what eager runs as written (measured on
    TF 2.21, see :mod:`towers.testing.replay`): a chain of adds on one device becomes one
    ``AddN`` with its inputs reordered, and ``x / n`` becomes ``x * (1/n)``. So a traced
    sum is held to the bound for ``graph_depth`` (the depth under any regrouping), a traced
    mean to one more rounding; max, min and integer sums must equal eager bitwise. The
    towers must agree bitwise in any case: each chunk is still reduced once.

    Returns:
        tower 0's traced and eager results.
    """
    arrays = make_arrays(case)
    devices = DEVICES[: case.n]
    placed: list[str] = []  # where the graph puts each output (a call returns them to CPU:0)

    @tf.function
    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        values = []
        for x, d in zip(xs, devices, strict=True):
            with tf.device(d):
                values.append(tf.identity(x))
        outs = algorithm(values, op=case.op)
        placed.extend(canonical_device(o.device) for o in outs)
        return outs

    tensors = [tf.constant(a) for a in arrays]
    kinds = {o.type for o in run.get_concrete_function(*tensors).graph.get_operations()}
    assert kinds <= PLAIN_OPS, f"ops a NumPy replay would not know: {kinds - PLAIN_OPS}"
    assert placed == list(devices)
    traced = [o.numpy() for o in run(*tensors)]
    assert all(t.tobytes() == traced[0].tobytes() for t in traced), "towers differ"
    eager = algorithm(place(arrays), op=case.op)[0].numpy()
    if case.op in ("sum", "mean") and case.dtype.is_floating:
        assert_matches_reference(traced, arrays, case.op, graph_depth + (case.op == "mean"))
    else:
        assert traced[0].tobytes() == eager.tobytes()
    return traced[0], eager


def assert_base_checks(algorithm: Callable[..., list[tf.Tensor]]) -> None:
    """The contract's input checks, as ``base.check_values`` raises them."""
    with tf.device(DEVICES[0]):
        a = tf.identity(tf.ones([3]))
        ai = tf.identity(tf.ones([3], tf.int32))
    with tf.device(DEVICES[1]):
        b = tf.identity(tf.ones([4]))
        b3 = tf.identity(tf.ones([3]))
        bi = tf.identity(tf.ones([3], tf.int32))
    with pytest.raises(ValueError, match=r"tower 0.*tower 1"):
        algorithm([a, b])
    with pytest.raises(ValueError, match="empty"):
        algorithm([])
    with pytest.raises(ValueError, match="both on"):
        algorithm([a, a])
    with pytest.raises(ValueError, match="op must be one of"):
        algorithm([a, b3], op="prod")
    with pytest.raises(ValueError, match="integer"):
        algorithm([ai, bi], op="mean")


# --- pad_split / unsplit ---------------------------------------------------------------


@given(st.sampled_from(SHAPES), st.sampled_from(DTYPES), st.integers(1, 9), st.integers(0, 7))
def test_pad_split_then_unsplit_is_identity(
    shape: tuple[int, ...], dtype: tf.DType, pieces: int, tower: int
) -> None:
    with tf.device(DEVICES[tower]):
        x = tf.identity(tf.constant(make_arrays(Case(1, shape, dtype, "sum", pieces))[0]))
    chunks, got_shape, size = pad_split(x, pieces)
    assert got_shape == shape and size == int(np.prod(shape))
    length = -(-size // pieces)
    assert len(chunks) == pieces and all(c.shape == (length,) for c in chunks)
    assert all(canonical_device(c.device) == DEVICES[tower] for c in chunks)
    padded = np.concatenate([c.numpy() for c in chunks])
    assert not padded[size:].any()
    y = unsplit(chunks, got_shape, size)
    assert y.shape == shape and canonical_device(y.device) == DEVICES[tower]
    assert y.numpy().tobytes() == x.numpy().tobytes()


@pytest.mark.parametrize("pieces", [0, -1, 1.5, True, "2"])
def test_pad_split_rejects_bad_pieces(pieces: Any) -> None:
    with pytest.raises(ValueError, match="pieces"):
        pad_split(tf.ones([4]), pieces)


def test_pad_split_needs_a_static_shape() -> None:
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def f(x: tf.Tensor) -> tf.Tensor:
        return pad_split(x, 2)[0][0]

    with pytest.raises(ValueError, match="static shape"):
        f.get_concrete_function()


def test_unsplit_refuses_chunks_on_two_devices() -> None:
    (a,) = place([np.ones(2, np.float32)])
    with tf.device(DEVICES[1]):
        b = tf.identity(tf.ones([2]))
    with pytest.raises(ValueError, match="chunks\\[1\\]"):
        unsplit([a, b], (4,), 4)
    with pytest.raises(ValueError, match="at least one"):
        unsplit([], (0,), 0)


def test_tick_offset_shifts_recorded_ticks_and_nests() -> None:
    (x,) = place([np.arange(3, dtype=np.float32)])
    with record() as rec:
        send(x, DEVICES[1], tick=0)
        with tick_offset(3) as total:
            assert total == 3
            y = send(x, DEVICES[1], tick=1)
            send(x, DEVICES[1])  # no tick: nothing to shift
            with tick_offset(2) as total:
                assert total == 5
                send(x, DEVICES[1], tick=0)
        send(x, DEVICES[1], tick=0)
    assert [t.tick for t in rec.transfers] == [0, 4, None, 5, 0]
    assert y.numpy().tobytes() == x.numpy().tobytes()  # labels move, data does not
    with pytest.raises(TypeError, match="tick offset must be an int"), tick_offset(1.5):  # type: ignore[arg-type]
        pass


def test_nested_records_leave_cleanly_when_equal() -> None:
    # Recorders compare by value: an inner one that saw what its parent saw equals it.
    (x,) = place([np.ones(2, np.float32)])
    with record() as outer:
        with record() as inner:
            send(x, DEVICES[1], tick=0)
        assert inner == outer
        send(x, DEVICES[2], tick=1)
    send(x, DEVICES[3], tick=2)  # recorded nowhere: both blocks are closed
    assert [t.dst for t in inner.transfers] == [DEVICES[1]]
    assert [t.dst for t in outer.transfers] == [DEVICES[1], DEVICES[2]]


def test_record_follows_the_data_each_send_carries_in_a_graph() -> None:
    (x,) = place([np.ones(2, np.float32)])

    @tf.function
    def forward(x: tf.Tensor) -> tf.Tensor:
        with tf.device(DEVICES[0]):
            x = tf.identity(x)
        a = send(x, DEVICES[1], tick=0)  # 0: the input
        b = send(x + 1, DEVICES[2], tick=0)  # 1: the input again
        with tf.device(DEVICES[1]):
            c = send(a * 2, DEVICES[3], tick=1)  # 2: computed from 0's received tensor
        with tf.device(DEVICES[2]):
            d = send(b + send(c, DEVICES[2]), DEVICES[0])  # 3: forwards 2; 4: from 1 and 3
        return d

    with record(follow_data=True) as rec:
        forward.get_concrete_function(x)
    assert rec.sources == [frozenset(), frozenset(), {0}, {2}, {1, 3}]
    with record() as plain:  # not asked (or an eager tensor): unknown
        send(x, DEVICES[1])
    assert plain.sources == [None]
