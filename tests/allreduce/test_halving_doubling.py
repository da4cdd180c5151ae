"""Rabenseifner halving-doubling: every output against the exact reduction, and its schedule.

The first section holds the value generator and thin checks shared with
``test_hierarchical`` and ``test_nccl``; the reference and the error bound themselves
are ``test_primitives``' (one derivation for every algorithm test).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import example, given
from hypothesis import strategies as st

from tests.allreduce.machinery.test_primitives import FLOATS, Case, assert_outputs
from tests.conftest import DEVICES
from towers.allreduce.halving_doubling import (
    cost,
    halving_doubling,
    halving_doubling_schedule,
)
from towers.allreduce.machinery.base import OPS
from towers.allreduce.machinery.primitives import record
from towers.devices import canonical_device
from towers.schedule import check_schedule, format_schedule, ir

bytes_sent = halving_doubling.bytes_sent  # counted from the schedule
summation_depth = halving_doubling.summation_depth

# ---- shared checks ---------------------------------------------------------------------------

INTS = (tf.int32, tf.int64)
SHAPES = [(), (0,), (1,), (2,), (7,), (13,), (3, 5), (2, 0, 3), (31,), (4, 4), (2, 3, 7)]


@st.composite
def cases(draw: st.DrawFn, towers: st.SearchStrategy[int] | None = None) -> Case:
    """Tower count 1-8, a shape from SHAPES, a supported dtype, an op (mean only for floats)."""
    n = draw(towers or st.integers(1, 8))
    dtype = draw(st.sampled_from(FLOATS + INTS))
    ops = OPS if dtype.is_floating else tuple(o for o in OPS if o != "mean")
    return Case(
        n,
        draw(st.sampled_from(SHAPES)),
        dtype,
        draw(st.sampled_from(ops)),
        draw(st.integers(0, 2**32 - 1)),
    )


def _floats(rng: np.random.Generator, dtype: tf.DType, size: int) -> np.ndarray:
    # |x| in [2^-1, 2^(top+1)) or 0. The floor keeps every nonzero partial sum a multiple of
    # ulp(1/2) and every mean normal: TF's CPU kernels flush subnormals to zero, which the
    # relative error model does not cover. The cap keeps a sum of 8 halves below 65504.
    top = 9 if dtype in (tf.float16, tf.bfloat16) else 20
    x = rng.choice([-1.0, 1.0], size) * rng.uniform(1, 2, size) * 2.0 ** rng.integers(-1, top, size)
    x[rng.random(size) < 0.1] = 0.0
    return x.astype(dtype.as_numpy_dtype)


def make_values(case: Case, devices: list[str] | None = None) -> list[tf.Tensor]:
    """One random tensor per tower, each created on its device (DEVICES by default)."""
    rng = np.random.default_rng(case.seed)
    size = int(np.prod(case.shape, dtype=np.int64))
    values, first = [], None
    for device in devices or DEVICES[: case.n]:
        if case.dtype.is_integer:  # small enough that a sum of 8 cannot overflow
            limit = 2**27 if case.dtype == tf.int32 else 2**59
            x = rng.integers(-limit, limit, size, dtype=case.dtype.as_numpy_dtype)
        else:
            x = _floats(rng, case.dtype, size)
        if first is not None and rng.random() < 0.3:
            x[: size // 2] = first[: size // 2]  # ties for max/min
        first = x if first is None else first
        with tf.device(device):
            values.append(tf.constant(x.reshape(case.shape), dtype=case.dtype))
    return values


def check_all_reduce(
    outputs: list[tf.Tensor],
    values: list[tf.Tensor],
    op: str,
    depth: int,
    devices: list[str] | None = None,
) -> float:
    """Check every output (see ``test_primitives``' bound); return the largest error in ULPs.

    The mean allows two roundings after the sum: some callers run inside a tf.function,
    where Grappler folds ``x / n`` into ``x · fl(1/n)``.
    """
    return assert_outputs(outputs, values, op, depth, devices=devices, mean_roundings=2).ulps


def check_bytes(recorder: object, devices: list[str], expected: list[int]) -> None:
    """Recorded bytes per tower equal the formula (padding included)."""
    sent = recorder.bytes_sent()  # type: ignore[attr-defined]
    assert sorted(set(sent) - set(devices)) == [], f"sends from non-towers: {sent}"
    assert [sent.get(d, 0) for d in devices] == expected


def nbytes(case: Case) -> int:
    return int(np.prod(case.shape, dtype=np.int64)) * case.dtype.size


# ---- halving_doubling ------------------------------------------------------------------------


@given(cases())
@example(Case(1, (), tf.float32, "sum", 0))
@example(Case(8, (0,), tf.float16, "mean", 1))
@example(Case(5, (13,), tf.bfloat16, "mean", 2))
@example(Case(6, (7,), tf.int64, "max", 3))
@example(Case(7, (2, 3, 7), tf.float32, "sum", 4))
def test_every_output_matches_reduction(case: Case) -> None:
    values = make_values(case)
    with record() as rec:
        outputs = halving_doubling()(values, op=case.op)
    check_all_reduce(outputs, values, case.op, summation_depth(case.n))
    check_bytes(rec, DEVICES[: case.n], bytes_sent(case.n, nbytes(case), case.dtype.size))


@pytest.mark.parametrize("n", [3, 4, 6, 8])
def test_inside_tf_function(n: int) -> None:
    case = Case(n, (3, 5), tf.float32, "mean", n)
    values = make_values(case)
    placed: list[str] = []

    @tf.function
    def run(*xs: tf.Tensor) -> list[tf.Tensor]:
        moved = []
        for x, device in zip(xs, DEVICES, strict=False):
            with tf.device(device):
                moved.append(tf.identity(x))
        with record() as rec:
            outs = halving_doubling()(moved, op="mean")
        check_bytes(rec, DEVICES[:n], bytes_sent(n, nbytes(case), 4))
        placed.extend(canonical_device(o.device) for o in outs)
        return outs

    outputs = run(*values)
    assert placed == DEVICES[:n]
    # Eager outputs of a tf.function on CPUs are labelled with the caller's device.
    check_all_reduce(outputs, values, "mean", summation_depth(n), devices=[DEVICES[0]] * n)


def test_schedule_ticks() -> None:
    for n, ticks in [(1, 0), (2, 2), (4, 4), (6, 6), (8, 6)]:
        values = make_values(Case(n, (5,), tf.float32, "sum", 0))
        with record() as rec:
            halving_doubling()(values)
        assert rec.ticks() == ticks, n


def test_bytes_sent_formula() -> None:
    assert bytes_sent(1, 40, 4) == [0]
    assert bytes_sent(4, 16, 4) == [24, 24, 24, 24]
    # n = 6: p = 4, L = 5 padded to 8 (c = 2): 2·3·2·4 = 48, plus the 4 padded chunks
    # (4·2·4 = 32) folded in and out.
    assert bytes_sent(6, 20, 4) == [80, 80, 48, 48, 32, 32]
    assert bytes_sent(3, 0, 8) == [0, 0, 0]
    with pytest.raises(ValueError):
        bytes_sent(0, 4, 4)


def _closed_bytes(n: int, nbytes: int, itemsize: int) -> list[int]:
    """The module docstring's closed form: 2(p−1)·c, plus p·c for each fold message."""
    p = 1 << (n.bit_length() - 1)
    chunk = -(-(nbytes // itemsize) // p) * itemsize
    return [2 * (p - 1) * chunk + p * chunk * (i < n - p) for i in range(p)] + [p * chunk] * (n - p)


@pytest.mark.parametrize("n", range(1, 17))
def test_schedule_derived_numbers_equal_the_closed_forms(n: int) -> None:
    schedule = halving_doubling_schedule(n)
    for length, itemsize in [(0, 4), (1, 4), (5, 2), (n, 8), (3 * n + 1, 4), (101, 4)]:
        assert bytes_sent(n, length * itemsize, itemsize) == _closed_bytes(
            n, length * itemsize, itemsize)
    assert summation_depth(n) == (n - 1).bit_length()  # ⌈log2 n⌉
    assert ir.cost(schedule, 1000.0) == cost(n, 1000.0)
    p = 1 << (n.bit_length() - 1)
    assert schedule.num_ticks == 2 * (p.bit_length() - 1) + 2 * (n > p)


def test_schedule_is_proved_for_1_to_64_towers() -> None:
    report = check_schedule(halving_doubling_schedule, range(1, 65))
    assert report.ok, str(report)


def test_summation_depth() -> None:
    assert [summation_depth(n) for n in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]


def test_drawn_schedule_matches_the_generator() -> None:
    rows = format_schedule(halving_doubling_schedule(6)).splitlines()
    assert rows[1].split() == ["tower", "0", "c2c3+▶2", "c1+▶1", "c0", "▶1", "c0c1", "▶2",
                               "c0c1c2c3", "▶4"]
    assert rows[5].split() == ["tower", "4", "c0c1c2c3+▶0"]


def test_unknown_shape_is_refused() -> None:
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
    def run(x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
        with tf.device(DEVICES[0]):
            x = tf.identity(x)
        with tf.device(DEVICES[1]):
            y = tf.identity(y)
        return halving_doubling()([x, y])

    with pytest.raises(ValueError, match="fully defined static shape"):
        run.get_concrete_function()


def test_replay_is_bitwise() -> None:
    replay = pytest.importorskip("towers.testing.replay").replay
    for n, op in [(3, "sum"), (6, "mean"), (8, "max")]:
        values = make_values(Case(n, (13,), tf.float32, op, n))
        expected = [o.numpy() for o in halving_doubling()(values, op=op)]
        got = replay(halving_doubling(), [v.numpy() for v in values], op, devices=DEVICES[:n])
        assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True)), (n, op)
