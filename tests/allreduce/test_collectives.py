"""Public reduce_scatter / all_gather / broadcast: every algorithm × n = 1..8 against NumPy.

Reduce-scatter reorders sums, so its shards are compared bitwise with a NumPy
replay of the same schedule (the same additions in the same order, which IEEE
arithmetic makes bitwise reproducible) and, independently, with the exact sum
within :func:`towers.testing.bounds.sum_bound` at the record's summation depth.
All-gather and broadcast only copy: bitwise equal to NumPy's concatenation / value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import DEVICES, examples
from towers.allreduce import COLLECTIVE_ALGORITHMS, all_gather, broadcast, reduce_scatter
from towers.allreduce.machinery.primitives import record
from towers.devices import canonical_device
from towers.schedule import (
    Schedule,
    ScheduleError,
    Step,
    chain_broadcast,
    even_sizes,
    ring_all_gather,
    ring_reduce_scatter,
)
from towers.testing.bounds import sum_bound

DTYPES = (np.float32, np.float64, np.int32)
NS = range(1, 9)
COMBINE: dict[str, Callable[[Any, Any], Any]] = {
    "sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply}


def _algorithms(collective: str) -> list[str]:
    return sorted(name for c, name in COLLECTIVE_ALGORITHMS if c == collective)


def replay(schedule: Schedule, slots: list[list[Any]], op: str = "sum") -> list[list[Any]]:
    """The schedule in NumPy: sources read as the tick began, ``combine(received, own)``."""
    n, full = schedule.towers, (1 << schedule.towers) - 1
    reducing = schedule.collective == "reduce_scatter"
    have = [[(1 << t if reducing else full) if x is not None else 0 for x in row]
            for t, row in enumerate(slots)]
    for tick in schedule.ticks:
        sent = [(slots[s.src][s.chunk], have[s.src][s.chunk]) for s in tick]
        for s, (x, mask) in zip(tick, sent):
            if s.kind == "reduce" and have[s.dst][s.chunk]:
                x, mask = COMBINE[op](x, slots[s.dst][s.chunk]), mask | have[s.dst][s.chunk]
                if op == "mean" and mask == full:
                    x = x / x.dtype.type(n)
            slots[s.dst][s.chunk], have[s.dst][s.chunk] = x, mask
    return slots


def assert_bitwise(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, shape and bytes (``-0.0`` differs from ``0.0`` here)."""
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    np.testing.assert_array_equal(np.ascontiguousarray(got).view(np.uint8),
                                  np.ascontiguousarray(want).view(np.uint8))


def _place(arrays: list[np.ndarray]) -> list[tf.Tensor]:
    out = []
    for array, device in zip(arrays, DEVICES):
        with tf.device(device):
            out.append(tf.constant(array))
    return out


def _values(n: int, shape: tuple[int, ...], dtype: Any, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-1000, 1000, shape).astype(dtype) for _ in range(n)]
    return [(rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(dtype)
            for _ in range(n)]


def _assert_on_devices(outputs: list[tf.Tensor], n: int) -> None:
    assert [canonical_device(x.device) for x in outputs] == [
        canonical_device(d) for d in DEVICES[:n]]


def _assert_bytes(recorder: Any, expected: list[int], n: int) -> None:
    sent = recorder.bytes_sent()
    assert [sent.get(canonical_device(d), 0) for d in DEVICES[:n]] == expected


def _check_reduce_scatter(algorithm: str, arrays: list[np.ndarray], op: str) -> None:
    n, length = len(arrays), arrays[0].size
    with record() as recorder:
        shards = reduce_scatter(_place(arrays), algorithm=algorithm, op=op)
    record_ = COLLECTIVE_ALGORITHMS[("reduce_scatter", algorithm)]
    sizes = even_sizes(length, n)
    pieces = [list(np.split(a.ravel(), np.cumsum(sizes)[:-1])) for a in arrays]
    want = replay(record_.generator(n), pieces, op)
    if n == 1 and op == "mean":
        want[0] = [x / x.dtype.type(1) for x in want[0]]
    _assert_on_devices(shards, n)
    for i, shard in enumerate(shards):
        got = shard.numpy()
        assert got.dtype == arrays[0].dtype and got.shape == (sizes[i],)
        assert_bitwise(got, want[i][i])
    exact, tol = sum_bound([a.ravel() for a in arrays], op, record_.summation_depth(n))
    got_all = np.concatenate([s.numpy() for s in shards]).astype(np.float64)
    assert np.all(np.abs(got_all - exact) <= tol), np.max(np.abs(got_all - exact) - tol)
    _assert_bytes(recorder, record_.bytes_sent(n, length * arrays[0].itemsize,
                                               arrays[0].itemsize), n)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("algorithm", _algorithms("reduce_scatter"))
def test_reduce_scatter_matches_numpy_for_every_dtype_and_size(algorithm: str, n: int) -> None:
    shapes = [(), (0,), (max(n - 1, 1),), (2, 5), (3 * n + 2,)]  # L=1, 0, < n, 10, n ∤ L
    for k, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in shapes):
        _check_reduce_scatter(algorithm, _values(n, shape, dtype, seed=k), "sum")
    for op in ("mean", "max", "min"):
        _check_reduce_scatter(algorithm, _values(n, (3 * n + 1,), np.float32, seed=n), op)


@pytest.mark.parametrize("algorithm", _algorithms("reduce_scatter"))
def test_reduce_scatter_product(algorithm: str) -> None:
    """Powers of two and zeros: exact products, so each shard equals NumPy's product."""
    rng = np.random.default_rng(3)
    for n in (1, 3, 4, 7):
        arrays = [rng.choice([-2.0, -0.5, 0.0, 1.0, 2.0], 2 * n + 1).astype(np.float32)
                  for _ in range(n)]
        shards = reduce_scatter(_place(arrays), algorithm=algorithm, op="product")
        want = np.split(np.prod(arrays, axis=0), np.cumsum(even_sizes(2 * n + 1, n))[:-1])
        for got, w in zip(shards, want, strict=True):
            assert_bitwise(got.numpy(), w)


@pytest.mark.parametrize("dtype", [np.float16, tf.bfloat16.as_numpy_dtype], ids=["f16", "bf16"])
def test_reduce_scatter_in_half_precision(dtype: Any) -> None:
    for algorithm in _algorithms("reduce_scatter"):
        for n in (3, 5):
            arrays = [a.astype(dtype) for a in _values(n, (2 * n + 1,), np.float32, seed=n)]
            _check_reduce_scatter(algorithm, arrays, "sum")


@settings(max_examples=examples(ci=8))
@given(n=st.integers(1, 8), length=st.integers(0, 40), data=st.data())
def test_reduce_scatter_property(n: int, length: int, data: Any) -> None:
    algorithm = data.draw(st.sampled_from(_algorithms("reduce_scatter")))
    dtype = data.draw(st.sampled_from(DTYPES))
    bounded = ["sum", "mean", "max", "min"]  # sum_bound's ops (product: its own test)
    op = data.draw(st.sampled_from(["sum", "max"] if dtype == np.int32 else bounded))
    _check_reduce_scatter(algorithm, _values(n, (length,), dtype, seed=length), op)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("algorithm", _algorithms("all_gather"))
def test_all_gather_concatenates_bitwise_on_every_tower(algorithm: str, n: int) -> None:
    record_ = COLLECTIVE_ALGORITHMS[("all_gather", algorithm)]
    for k, dtype in enumerate(DTYPES):
        for length in (0, max(n - 1, 1), 3 * n + 2):  # empty, L < n, not divisible
            full = _values(1, (length,), dtype, seed=k)[0]
            shards = np.split(full, np.cumsum(even_sizes(length, n))[:-1])
            with record() as recorder:
                out = all_gather(_place(list(shards)), algorithm=algorithm)
            _assert_on_devices(out, n)
            for x in out:
                assert_bitwise(x.numpy(), full)
            _assert_bytes(recorder, record_.bytes_sent(n, full.nbytes, full.itemsize), n)
    ragged = [np.full((i % 3, 2), i, np.float32) for i in range(n)]  # any first-axis sizes
    for x in all_gather(_place(ragged), algorithm=algorithm):
        assert_bitwise(x.numpy(), np.concatenate(ragged))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("algorithm", _algorithms("broadcast"))
def test_broadcast_copies_bitwise_from_every_root(algorithm: str, n: int) -> None:
    record_ = COLLECTIVE_ALGORITHMS[("broadcast", algorithm)]
    cases = [(d, s) for d in DTYPES for s in ((2, 3), (), (0,), (3 * n + 1,))]
    for k, (dtype, shape) in enumerate(cases):
        root = k % n
        value = _values(1, shape, dtype, seed=k)[0]
        with tf.device(DEVICES[root]):
            x = tf.constant(value)
        with record() as recorder:
            out = broadcast(x, DEVICES[:n], root=root, algorithm=algorithm)
        _assert_on_devices(out, n)
        assert out[root] is x
        for y in out:
            assert_bitwise(y.numpy(), value)
        expected = record_.bytes_sent(n, value.nbytes, value.itemsize)
        _assert_bytes(recorder, expected[-root:] + expected[:-root], n)  # towers turned by root


def test_all_gather_inverts_reduce_scatter_into_the_exact_integer_sum() -> None:
    arrays = _values(5, (3, 7), np.int32, seed=1)
    for rs, ag in (("ring", "doubling"), ("halving", "ring")):
        out = all_gather(reduce_scatter(_place(arrays), algorithm=rs), algorithm=ag)
        for x in out:
            np.testing.assert_array_equal(x.numpy(), np.sum(arrays, axis=0, dtype=np.int32).ravel(),
                                          strict=True)


def test_a_schedule_generator_is_an_algorithm_and_is_proved_before_it_runs() -> None:
    with tf.device(DEVICES[2]):
        x = tf.range(20.0)
    with record() as recorder:
        out = broadcast(x, DEVICES[:4], root=2, algorithm=functools.partial(chain_broadcast,
                                                                            chunks=5))
    assert len(recorder.transfers) == 5 * 3 and all(np.array_equal(y, x) for y in out)

    def dropped(n: int) -> Schedule:  # the ring reduce-scatter without its last tick
        return Schedule("short", n, n, ring_reduce_scatter(n).ticks[:-1], "reduce_scatter")

    with record() as recorder, pytest.raises(ScheduleError, match="dropped chunk"):
        reduce_scatter(_place(_values(3, (6,), np.float32, 0)), algorithm=dropped)
    assert recorder.transfers == []
    with pytest.raises(ValueError, match="algorithm must give a reduce_scatter Schedule"):
        reduce_scatter(_place(_values(3, (6,), np.float32, 0)), algorithm=ring_all_gather)


def test_collectives_run_inside_tf_function() -> None:
    @tf.function
    def step() -> list[tf.Tensor]:
        values = []
        for i, device in enumerate(DEVICES[:3]):
            with tf.device(device):
                values.append(tf.range(7.0) * float(i + 1))
        return all_gather(reduce_scatter(values, algorithm="halving"), algorithm="doubling")

    for x in step():
        np.testing.assert_array_equal(x.numpy(), np.arange(7.0, dtype=np.float32) * 6)


def _bad(fn: Callable[[], Any], error: type[Exception], words: str) -> None:
    with pytest.raises(error) as raised:
        fn()
    assert words in str(raised.value), str(raised.value)


def test_values_without_a_device_are_named() -> None:
    @tf.function
    def gather(x: tf.Tensor) -> list[tf.Tensor]:
        return all_gather([x[:2], x[2:]])

    _bad(lambda: gather(tf.range(4.0)), ValueError, "shards[0] has no device")

    @tf.function
    def spread(x: tf.Tensor) -> list[tf.Tensor]:
        return broadcast(x, DEVICES[:2])

    _bad(lambda: spread(tf.range(4.0)), ValueError, "value has no device")


def test_bad_inputs_name_the_argument_and_what_was_expected() -> None:
    a, b = _place([np.zeros(4, np.float32), np.zeros(4, np.float32)])
    c = _place([np.zeros(4, np.float64)] * 2)[1]
    with tf.device(DEVICES[1]):
        d, s = tf.zeros([5], tf.float32), tf.constant(1.0)
    _bad(lambda: reduce_scatter([]), ValueError, "values is empty")
    _bad(lambda: reduce_scatter(a), TypeError, "values must be a list")
    _bad(lambda: reduce_scatter([a, c]), ValueError, "differ in dtype")
    _bad(lambda: reduce_scatter([a, d]), ValueError, "differ in shape")
    _bad(lambda: reduce_scatter([a, a]), ValueError, "both on")
    _bad(lambda: reduce_scatter([a, b], op="prod"), ValueError, "op must be one of")
    _bad(lambda: reduce_scatter([a, b], algorithm="doubling"), ValueError,
         "algorithm must be one of halving, ring for reduce_scatter")
    _bad(lambda: reduce_scatter([a, b], algorithm=3), TypeError, "algorithm must be a name")
    _bad(lambda: all_gather([]), ValueError, "shards is empty")
    _bad(lambda: all_gather([a, s]), ValueError, "shards[1] is a scalar")
    _bad(lambda: all_gather([a, c]), ValueError, "shards differ in dtype")
    _bad(lambda: all_gather([tf.reshape(a, [2, 2]), tf.reshape(d[:4], [1, 4])]), ValueError,
         "shards differ beyond axis 0")
    _bad(lambda: all_gather([a, a]), ValueError, "both on")
    _bad(lambda: all_gather([a, b], algorithm="tree"), ValueError, "algorithm must be one of")
    _bad(lambda: broadcast(a, []), ValueError, "devices must be a non-empty list")
    _bad(lambda: broadcast(a, DEVICES[0]), ValueError, "devices must be a non-empty list")
    _bad(lambda: broadcast(a, [DEVICES[0], DEVICES[0]]), ValueError, "are both")
    _bad(lambda: broadcast(a, DEVICES[:2], root=2), ValueError, "root must be an index")
    _bad(lambda: broadcast(a, DEVICES[:2], root=1), ValueError, "not on devices[root=1]")
    _bad(lambda: broadcast(np.zeros(3), DEVICES[:2]), TypeError, "value must be a tf.Tensor")
    _bad(lambda: broadcast(a, DEVICES[:2], algorithm="ring"), ValueError,
         "algorithm must be one of chain, flat, tree for broadcast")
    _bad(lambda: broadcast(a, DEVICES[:2], algorithm=lambda n: Schedule(
        "x", n, 1, ((Step(1, 0, 0, "copy"),),), "broadcast")), ScheduleError,
        "send before receipt")
