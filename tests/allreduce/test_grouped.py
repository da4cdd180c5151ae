"""``grouped``: a list of tensors per tower, every op and ``IndexedSlices``, bitwise the
per-tensor ``towers.all_reduce`` of each position."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import grouped

NAMES = sorted(towers.ALGORITHMS)
SHAPES = [(3, 4), (), (7,), (2, 2, 2)]


def _tower(rng: np.random.Generator, device: str, op: str) -> list[tf.Tensor]:
    # small integers (sums exact in any order) or powers of two (products exact)
    pool = [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0] if op == "product" else np.arange(-8.0, 9.0)
    with tf.device(device):
        return [tf.constant(rng.choice(pool, s), dtype)
                for s, dtype in zip(SHAPES, (tf.float32, tf.float64, tf.float16, tf.float32))]


@pytest.mark.long
@pytest.mark.parametrize("name", NAMES)
def test_grouped_is_the_per_tensor_all_reduce(name: str) -> None:
    rng = np.random.default_rng(2)
    for n in (1, 3, 8):
        for op in ("sum", "mean", "max", "min", "product"):
            values = [_tower(rng, DEVICES[t], op) for t in range(n)]
            for bucket in (None, 16):
                got = grouped(values, name, op, bytes_per_bucket=bucket)
                for k in range(len(SHAPES)):
                    want = towers.all_reduce([v[k] for v in values], algorithm=name, op=op)
                    for t in range(n):
                        assert got[t][k].device == want[t].device
                        assert got[t][k].numpy().tobytes() == want[t].numpy().tobytes(), (
                            f"{name} {op} n={n} tensor {k} tower {t}")


def _slices(rng: np.random.Generator, device: str) -> tf.IndexedSlices:
    with tf.device(device):
        rows = int(rng.integers(1, 4))
        return tf.IndexedSlices(tf.constant(rng.normal(size=(rows, 3)), tf.float32),
                                tf.constant(rng.integers(0, 5, rows), tf.int64),
                                tf.constant([5, 3], tf.int64))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_grouped_indexed_slices_are_gathered(op: str) -> None:
    rng = np.random.default_rng(4)
    for n in (1, 2, 4, 8):
        values = []
        for t in range(n):
            with tf.device(DEVICES[t]):
                dense = tf.constant(rng.normal(size=(2, 3)), tf.float32)
            values.append([_slices(rng, DEVICES[t]), dense])
        got = grouped(values, "ring", op)
        sparse = towers.all_reduce([v[0] for v in values], algorithm="ring", op=op)
        dense = towers.all_reduce([v[1] for v in values], algorithm="ring", op=op)
        for t in range(n):
            assert isinstance(got[t][0], tf.IndexedSlices)
            for part in ("values", "indices"):
                assert (getattr(got[t][0], part).numpy().tobytes()
                        == getattr(sparse[t], part).numpy().tobytes())
            assert got[t][1].numpy().tobytes() == dense[t].numpy().tobytes()


def test_grouped_refusals_name_what_is_wrong() -> None:
    rng = np.random.default_rng(0)
    values = [[_slices(rng, DEVICES[t])] for t in range(2)]
    for op in ("max", "min", "product"):
        with pytest.raises(ValueError, match=rf"values\[0\]\[0\] is an IndexedSlices: .*{op}"):
            grouped(values, "ring", op)
    mixed = [_tower(rng, DEVICES[0], "sum"), _tower(rng, DEVICES[1], "sum")[:2]]
    with pytest.raises(ValueError, match="tower 1's values differ from tower 0's in count"):
        grouped(mixed, "ring")
    ints = []
    for t in range(2):
        with tf.device(DEVICES[t]):
            ints.append([tf.constant([1, 2], tf.int32)])
    with pytest.raises(ValueError, match="op='mean' is not defined for integer dtype int32"):
        grouped(ints, "ring", "mean")
