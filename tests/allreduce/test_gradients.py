"""Gradients through every registered all-reduce, against a one-device reference.

The loss weights each tower's output differently (``Σ_i w_i · out_i``, ``w`` integer
multiples of ``n``), so each tower's upstream gradient differs and the gradient must
gather all of them. The reference reduces the stacked towers on one device (``tf.reduce_sum``,
``tf.reduce_max``, ``tf.reduce_min`` over ``tf.stack(values)``; ``mean`` is the sum over
``n``) and differentiates the same loss. Integer-valued weights make both sides exact,
so every tower's gradient is compared bitwise. Values are distinct, so ``max``/``min``
have one extreme per element (ties: towers.allreduce.nccl.differentiable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

import towers
from tests.conftest import DEVICES
from towers.allreduce import bucketed
from towers.allreduce.nccl import differentiable

NAMES = sorted(towers.ALGORITHMS)
OPS = ("sum", "mean", "max", "min", "product")
SHAPE = (3, 4)


def _reference(values: list[tf.Tensor], op: str) -> tf.Tensor:
    stacked = tf.stack(values)
    if op == "max":
        return tf.reduce_max(stacked, axis=0)
    if op == "min":
        return tf.reduce_min(stacked, axis=0)
    if op == "product":
        return tf.reduce_prod(stacked, axis=0)
    total = tf.reduce_sum(stacked, axis=0)
    return total / len(values) if op == "mean" else total


def _inputs(n: int, seed: int, op: str = "sum") -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    distinct = rng.permutation(n * 12).reshape(n, *SHAPE).astype(np.float32) - 6 * n
    values = [x * np.float32(0.5) for x in distinct]  # no two towers tie anywhere
    if op == "product":  # powers of two and zeros: every product exact, in any order
        values = [rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], SHAPE).astype(np.float32)
                  for _ in range(n)]
    # Multiples of n: a mean's w_i / n is exact too, however the algorithm rounds it (the
    # hand-built ones divide each tower's upstream gradient, the reference divides Σ w_i).
    weights = [rng.integers(-4, 5, SHAPE).astype(np.float32) * n for _ in range(n)]
    return values, weights


def _gradients(reduce: Callable[[list[tf.Tensor]], list[tf.Tensor]],
               values: list[np.ndarray], weights: list[np.ndarray]) -> list[np.ndarray]:
    xs = []
    for value, device in zip(values, DEVICES):
        with tf.device(device):
            xs.append(tf.constant(value))
    with tf.GradientTape() as tape:
        tape.watch(xs)
        outs = reduce(xs)
        loss = tf.add_n([tf.reduce_sum(out * w) for out, w in zip(outs, weights)])
    grads = tape.gradient(loss, xs)
    assert all(g is not None for g in grads)
    return [g.numpy() for g in grads]


def _check(reduce: Callable[[list[tf.Tensor]], list[tf.Tensor]], op: str, n: int,
           seed: int = 0) -> None:
    values, weights = _inputs(n, seed, op)
    want = _gradients(lambda xs: [_reference(xs, op)] * n, values, weights)
    got = _gradients(reduce, values, weights)
    for tower, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, w, err_msg=f"tower {tower} of {n}, op={op}")


@pytest.mark.parametrize("name", NAMES)
def test_gradient_of_every_algorithm_equals_the_one_device_reference(name: str) -> None:
    for n in range(1, 9):
        for op in OPS:
            _check(lambda xs, op=op: towers.all_reduce(xs, algorithm=name, op=op), op, n, n)


@pytest.mark.parametrize("name", ["nccl", "nccl_ring", "nccl_tree", "ring"])
def test_gradient_inside_a_tf_function(name: str) -> None:
    n, values_, weights = 5, *_inputs(5, 1)
    algorithm = towers.ALGORITHMS[name]()

    @tf.function(autograph=False)
    def grads(*xs: tf.Tensor) -> Any:
        placed = []
        for x, device in zip(xs, DEVICES):
            with tf.device(device):
                placed.append(tf.identity(x))
        with tf.GradientTape() as tape:
            tape.watch(placed)
            outs = algorithm(placed, op="mean")
            loss = tf.add_n([tf.reduce_sum(o * w) for o, w in zip(outs, weights)])
        return tape.gradient(loss, placed)

    want = _gradients(lambda xs: [_reference(xs, "mean")] * n, values_, weights)
    for g, w in zip(grads(*values_), want):
        np.testing.assert_array_equal(g.numpy(), w)


@pytest.mark.parametrize("name", ["nccl", "nccl_ring", "nccl_tree", "ring", "naive"])
def test_gradient_through_bucketed(name: str) -> None:
    reducer = bucketed(name, bytes_per_bucket=40)  # 12 + 5 floats: three buckets
    shapes = [(3, 4), (5,)]
    for n in (1, 3, 4):
        rng = np.random.default_rng(n)
        grads_ = [[rng.integers(-9, 9, s).astype(np.float32) for s in shapes] for _ in range(n)]
        weights = [[rng.integers(-4, 5, s).astype(np.float32) for s in shapes]
                   for _ in range(n)]
        xs = []
        for tower, device in enumerate(DEVICES[:n]):
            with tf.device(device):
                xs.append([tf.constant(g) for g in grads_[tower]])
        with tf.GradientTape() as tape:
            tape.watch(xs)
            outs = reducer.reduce_gradients(xs)
            loss = tf.add_n([tf.reduce_sum(o * w) for t in range(n)
                             for o, w in zip(outs[t], weights[t])])
        got = tape.gradient(loss, xs)
        for v in range(len(shapes)):  # d loss / d x[t][v] = Σ_t' w[t'][v] on every tower
            want = np.sum([weights[t][v] for t in range(n)], axis=0)
            for t in range(n):
                np.testing.assert_array_equal(got[t][v].numpy(), want)


def test_ties_split_the_gradient_evenly_as_reduce_max_does() -> None:
    values = [np.float32([1.0, 5.0]), np.float32([3.0, 5.0]), np.float32([3.0, 2.0])]
    weights = [np.float32([1.0, 1.0])] * 3
    want = _gradients(lambda xs: [_reference(xs, "max")] * 3, values, weights)
    np.testing.assert_array_equal(want, [[0, 1.5], [1.5, 1.5], [1.5, 0]])
    for name in ("nccl", "nccl_ring", "nccl_tree"):
        got = _gradients(lambda xs, name=name: towers.all_reduce(xs, name, "max"),
                         values, weights)
        np.testing.assert_array_equal(got, want)


def test_integer_values_pass_through_without_a_gradient() -> None:
    fn = differentiable(towers.ALGORITHMS["nccl"]())
    xs = []
    for i, device in enumerate(DEVICES[:3]):
        with tf.device(device):
            xs.append(tf.constant([i, 2 * i], tf.int32))
    for out in fn(xs, op="sum"):
        np.testing.assert_array_equal(out.numpy(), [3, 6])
