"""A user's all-reduce, checked once to *sum* before the trainer's first step.

::

    values[tower] = small integers, distinct per tower     on the trainer's own devices,
          │                                                in the dtype the step sums in
          ▼  algorithm (in a tf.function, as the step runs it)
    outputs[tower] ── contract (count, shape, dtype, device: towers.allreduce.machinery.reducer)
                   └─ value: |outputs[tower] − Σ_i values[i]| ≤ γ_{n−1}·Σ_i |values[i]|

The trace-time contract reads static properties only: returning the inputs, or a mean,
would train silently wrong. Small integers sum exactly in float16, bfloat16 and float32,
so a wrong result misses the bound by at least 1. ``check_algorithm=False`` skips it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.base import GradientReducer, StatefulReducer
from towers.allreduce.machinery.reducer import check_outputs, check_rows
from towers.allreduce.machinery.registry import ALGORITHMS, algorithm_name, record_of
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.rounding import gamma
from towers.allreduce.naive import noop
from towers.guard.deadline import within
from towers.guard.errors import AlgorithmError

__all__ = ["CHECK_TIMEOUT", "check_sums", "unproved"]

CHECK_TIMEOUT = 60.0
"""Seconds the check may take when ``step_timeout`` is None (far above its need)."""

SHAPES = ((7,), (2, 3))
"""What a per-tensor algorithm is checked on: an odd length (padding) and a matrix."""

_HINT = (
    "Every tower must receive the sum of all towers' inputs, or the replicas drift apart "
    "(towers.testing.check_all_reduce shows where); pass check_algorithm=False to "
    "TowerTrainer to skip this check (e.g. for a lossy compression of your own)."
)


def _library_made(algorithm: Any) -> bool:
    while isinstance(algorithm, functools.partial):
        algorithm = algorithm.func
    module = getattr(algorithm, "__module__", None) or type(algorithm).__module__
    return module == "towers" or module.startswith("towers.")


def unproved(algorithm: Any) -> Any | None:
    """The user's algorithm inside ``algorithm`` that the library has not proved, or None:
    a library algorithm or wrapper is as good as the algorithms it was given."""
    if algorithm is noop:  # library-made, but it does not reduce: never proved to sum
        return algorithm
    configured = record_of(algorithm)
    if configured is not None:
        # a user's register(Algorithm(...)) gives any callable a record: only the library's
        # own are proved, and only when their parts (hierarchical's inner/outer) are
        if not _library_made(configured.run):
            return algorithm
        parts = [get(p) if isinstance(p, str) and p in ALGORITHMS else p
                 for p in configured.params.values()]  # a part may be a registered name
        return algorithm if any(unproved(p) is not None for p in parts if callable(p)) else None
    if _library_made(algorithm):
        inner = getattr(algorithm, "algorithm", None)
        return unproved(inner) if callable(inner) else None
    return algorithm


def _tf_values(shape: Sequence[int], tower: int, dtype: tf.DType) -> tf.Tensor:
    """Integers in [-3, 3], different on every tower (so no output can equal its input),
    made by ops on the current device (no large constants in the graph)."""
    size = int(np.prod(shape))
    ints = tf.math.floormod(tf.range(size, dtype=tf.int64) * (2 * tower + 3) + 5 * tower + 1, 7)
    return tf.cast(tf.reshape(ints - 3, shape), dtype)


def _compare(algorithm: Any, shapes: Sequence[Sequence[int]], dtypes: Sequence[tf.DType],
             outputs: list[list[np.ndarray]], names: list[str]) -> None:  # fmt: skip
    n, k = len(outputs), max(len(outputs) - 1, 0)
    for j, name in enumerate(names):
        stack = np.stack([_tf_values(shapes[j], t, tf.float64).numpy() for t in range(n)])
        exact, magnitude = stack.sum(axis=0), np.abs(stack).sum(axis=0)
        tolerance = gamma(k, dtypes[j]) * magnitude  # γ_{n−1}·Σ|x_i|
        for tower in range(n):
            got = np.asarray(outputs[tower][j], np.float64)
            miss = np.abs(got - exact) - tolerance
            if np.any(miss > 0):
                e = np.unravel_index(int(np.argmax(miss)), miss.shape)
                raise AlgorithmError(
                    algorithm_name(algorithm), tower, f"{name} (a check value)",
                    f"the sum of the {n} towers' inputs (within γ_{k}·Σ|x_i|)",
                    f"{got[e]:g} instead of {exact[e]:g} at index {tuple(map(int, e))}",
                    hint=_HINT)  # fmt: skip


def _run(algorithm: Any, shapes: Sequence[Sequence[int]], dtypes: Sequence[tf.DType],
         devices: Sequence[str], names: list[str]) -> list[list[np.ndarray]]:  # fmt: skip
    """The outputs of ``algorithm`` run once in a ``tf.function``, contract checked."""

    def step() -> list[list[tf.Tensor]]:
        values = []
        for tower, device in enumerate(devices):
            with tf.device(device):
                values.append([_tf_values(s, tower, d) for s, d in zip(shapes, dtypes)])
        if isinstance(algorithm, StatefulReducer):  # the check commits no state
            rows, _ = algorithm.reduce_deferred(values)
            return check_rows(algorithm, values, rows, names)
        if isinstance(algorithm, GradientReducer):
            return check_rows(algorithm, values, algorithm.reduce_gradients(values), names)
        outs = [check_outputs(algorithm, [v[j] for v in values],
                              algorithm([v[j] for v in values], op="sum"), names[j])
                for j in range(len(names))]  # fmt: skip
        return [[outs[j][t] for j in range(len(names))] for t in range(len(devices))]

    result = tf.function(step, autograph=False)()
    return [[np.asarray(v.numpy()) for v in row] for row in result]


def check_sums(algorithm: Any, devices: Sequence[str], variables: Sequence[Any],
               wire_dtype: Any, seconds: float | None = None) -> None:  # fmt: skip
    """Refuse an unproved algorithm whose outputs are not the sum of its inputs, within
    ``seconds`` (None: :data:`CHECK_TIMEOUT`); ``wire_dtype(dtype)`` is what the step sums in.

    Raises:
        AlgorithmError: an output off the sum by more than the bound, or breaking the contract.
        TimeoutError, TypeError (not an algorithm), ValueError (it raised while traced).
    """
    user = unproved(algorithm)
    if user is None:
        return
    dtypes = [tf.as_dtype(wire_dtype(tf.as_dtype(v.dtype))) for v in variables]
    if isinstance(user, GradientReducer):
        shapes = [tuple(v.shape) for v in variables]
        names = [getattr(v, "path", None) or v.name for v in variables]
    else:
        unique = sorted({d.name for d in dtypes})
        shapes = [s for s in SHAPES for _ in unique]
        dtypes = [tf.as_dtype(d) for _ in SHAPES for d in unique]
        names = [f"shape {s} {d.name}" for s, d in zip(shapes, dtypes)]
    seconds = CHECK_TIMEOUT if seconds is None else seconds
    try:
        outputs = within(seconds, lambda: _run(user, shapes, dtypes, devices, names),
                         f"all_reduce: {algorithm_name(user)} did not complete within "
                         f"{seconds:g} s when the trainer ran it once on small values at "
                         "construction (a collective whose group some tower never joins, a "
                         "wait nobody ends). Fix the algorithm; the bound is step_timeout when "
                         "set, else towers.guard.reduces.CHECK_TIMEOUT; check_algorithm=False "
                         "skips the check. Collective ops in this process are now aborted: "
                         "restart it.")  # fmt: skip
    except (TimeoutError, AlgorithmError):
        raise
    except TypeError as err:  # not an algorithm(values, *, op) at all: a loss, a layer, …
        raise TypeError(f"all_reduce: {algorithm_name(user)} is not an all-reduce algorithm "
                        f"(values, *, op) -> list nor a GradientReducer: calling it on one "
                        f"tensor per tower failed with {type(err).__name__}: {err}") from err
    except Exception as err:  # its own bug while traced (.numpy() in a graph, a bad index, …)
        raise ValueError(f"all_reduce: {algorithm_name(user)} raised {type(err).__name__} when "
                         f"the trainer called it on one tensor per tower ({names[0]}, traced): "
                         f"{err} (towers.testing.check_all_reduce runs it the same way)") from err
    _compare(user, shapes, dtypes, outputs, names)
