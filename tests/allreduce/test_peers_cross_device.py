"""TensorFlow's ``cross_device_ops_test.py``, the cases beyond the dense one, for every algorithm.

Ported in our own code, with TensorFlow's inputs and its group sizes 1, 2 and 4 (one or two
processes times none, one or two GPUs), each output compared on its own:

* ``testAllReduceSparse``: every replica holds ``IndexedSlices([[1.]], [0], [5, 1])``.
* ``testBatchAllReduceDense``: every replica reduces ``(1.0, 2.0)`` in one batch.
* ``testBatchAllReduceSparse``: ``(slices, 1.0, slices, 2.0)`` in one batch.
* ``testAllReduceSparseVariableLength``: two replicas with one and three rows.
* ``testInputsAreFunctionArgs``: the values are arguments of the ``tf.function`` that reduces.
* ``testAllGatherSameShape`` / ``DifferentShape``: ``_gather(value, axis=0)`` as
  :func:`towers.allreduce.all_gather`.

Left out: reduce-to-one-device (towers has no destination argument: ``parameter_device`` is
that algorithm), the NCCL and multi-process variants (one process here; ``tests/cluster``
runs collective ops across tasks), and the timeout cases (``tests/guard`` covers the step's
deadline).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import towers
from towers.allreduce import all_gather, grouped

NAMES = sorted(towers.ALGORITHMS)
GROUP_SIZES = (1, 2, 4)


def _devices(n: int) -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("CPU")][:n]


def _slices(values: list[list[float]], indices: list[int], shape: list[int]) -> tf.IndexedSlices:
    return tf.IndexedSlices(tf.constant(values), tf.constant(indices, tf.int64),
                            tf.constant(shape, tf.int64))


def _per_tower(n: int, make) -> list:  # type: ignore[no-untyped-def]
    out = []
    for device in _devices(n):
        with tf.device(device):
            out.append(make())
    return out


def _dense(x: tf.Tensor | tf.IndexedSlices) -> np.ndarray:
    return tf.convert_to_tensor(x).numpy()


def _same_device(a: str, b: str) -> bool:
    a_spec, b_spec = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a_spec.device_type, a_spec.device_index) == (b_spec.device_type, b_spec.device_index)


def _assert_on_devices(outs: list, n: int) -> None:  # type: ignore[type-arg]
    for out, device in zip(outs, _devices(n)):
        for x in out:
            assert _same_device(x.device, device), (x.device, device)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_all_reduce_sparse(n: int, op: str) -> None:
    """``testAllReduceSparse``: row 0 of a [5, 1] table is n (sum) or 1 (mean) everywhere."""
    values = _per_tower(n, lambda: [_slices([[1.0]], [0], [5, 1])])
    want = np.zeros((5, 1), np.float32)
    want[0, 0] = n if op == "sum" else 1.0
    outs = grouped(values, "ring", op)
    _assert_on_devices(outs, n)
    for out in outs:
        assert isinstance(out[0], tf.IndexedSlices)
        np.testing.assert_array_equal(_dense(out[0]), want)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_batch_all_reduce_dense(name: str, op: str) -> None:
    """``testBatchAllReduceDense``: ``(1.0, 2.0)`` per replica gives ``(n, 2n)`` or ``(1, 2)``."""
    for n in GROUP_SIZES:
        values = _per_tower(n, lambda: [tf.constant(1.0), tf.constant(2.0)])
        scale = n if op == "sum" else 1
        outs = grouped(values, name, op)
        _assert_on_devices(outs, n)
        for out in outs:
            assert [x.numpy() for x in out] == [1.0 * scale, 2.0 * scale], (name, n, op)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_batch_all_reduce_sparse(name: str, op: str) -> None:
    """``testBatchAllReduceSparse``: slices and scalars in one batch, each reduced alone."""
    for n in GROUP_SIZES:
        values = _per_tower(n, lambda: [_slices([[1.0]], [0], [5, 1]), tf.constant(1.0),
                                        _slices([[3.0]], [2], [5, 1]), tf.constant(2.0)])
        scale = n if op == "sum" else 1
        first = np.zeros((5, 1), np.float32)
        first[0, 0] = 1.0 * scale
        third = np.zeros((5, 1), np.float32)
        third[2, 0] = 3.0 * scale
        for out in grouped(values, name, op):
            np.testing.assert_array_equal(_dense(out[0]), first)
            np.testing.assert_array_equal(_dense(out[2]), third)
            assert (out[1].numpy(), out[3].numpy()) == (1.0 * scale, 2.0 * scale)


def test_all_reduce_sparse_variable_length() -> None:
    """``testAllReduceSparseVariableLength``: rows of unequal count are gathered in replica
    order, exactly TensorFlow's expected ``IndexedSlices`` (values and indices, not only
    their dense sum)."""
    devices = _devices(2)
    with tf.device(devices[0]):
        a = _slices([[1.0]], [0], [10, 1])
    with tf.device(devices[1]):
        b = _slices([[2.0], [3.0], [4.0]], [0, 1, 2], [10, 1])
    for (out,) in grouped([[a], [b]], "ring", "sum"):
        np.testing.assert_array_equal(out.values.numpy(), [[1.0], [2.0], [3.0], [4.0]])
        np.testing.assert_array_equal(out.indices.numpy(), [0, 0, 1, 2])
        np.testing.assert_array_equal(out.dense_shape.numpy(), [10, 1])


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_function_args(name: str) -> None:
    """``testInputsAreFunctionArgs``: a ``tf.function`` takes the per-replica values as
    arguments and all-reduces them; replica ``i`` holds ``i + 1``. A traced argument has
    no device (TensorFlow places it when the function runs), so the devices are named, as
    TensorFlow's test names them to its collective; without them the error says so."""
    for n in GROUP_SIZES:
        devices = _devices(n)
        values = _per_tower(n, lambda: tf.constant([1.0, 2.0]))
        values = [v * (i + 1) for i, v in enumerate(values)]

        placed: list[str] = []

        @tf.function
        def reduce(*args: tf.Tensor) -> list[tf.Tensor]:
            outs = towers.all_reduce(list(args), algorithm=name, op="sum",
                                     devices=devices)  # noqa: B023
            placed.extend(out.device for out in outs)  # noqa: B023
            return outs

        want = np.array([1.0, 2.0], np.float32) * (n * (n + 1) // 2)
        outs = reduce(*values)
        assert len(outs) == len(placed) == n
        # a function's outputs come back labelled with the caller's CPU device, so where
        # each output was computed is read from the traced graph
        for out, op_device, device in zip(outs, placed, devices):
            np.testing.assert_array_equal(out.numpy(), want)
            assert _same_device(op_device, device), (name, op_device, device)

    @tf.function
    def unplaced(*args: tf.Tensor) -> list[tf.Tensor]:
        return towers.all_reduce(list(args), algorithm=name, op="sum")

    with pytest.raises(ValueError, match=r"values\[0\] has no device.*devices="):
        unplaced(*_per_tower(2, lambda: tf.constant(1.0)))


@pytest.mark.parametrize("algorithm", ["ring", "doubling"])
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_all_gather_same_and_different_shape(algorithm: str, n: int) -> None:
    """``testAllGatherSameShape`` / ``DifferentShape`` (``_gather(value, axis=0)``): every
    replica ends with the replicas' values concatenated in replica order, whether their
    first axes are equal or not."""
    for rows in ([2] * n, [i + 1 for i in range(n)]):
        devices = _devices(n)
        shards = []
        for i, device in enumerate(devices):
            with tf.device(device):
                shards.append(tf.fill([rows[i], 3], float(i)))
        want = np.concatenate([s.numpy() for s in shards], axis=0)
        outs = all_gather(shards, algorithm=algorithm)
        assert len(outs) == n
        for out, device in zip(outs, devices):
            np.testing.assert_array_equal(out.numpy(), want)
            assert _same_device(out.device, device), (out.device, device)
