"""Sparse values (``tf.IndexedSlices``): gather indices and values in tower order.

An Embedding's gradient is an ``IndexedSlices``; summing is concatenation, tower 0's rows
first, duplicates kept, as ``MirroredStrategy`` does (:func:`densify`: the dense sum)::

    tower:   0        1        2
    has:    s0       s1       s2
    gets:  [s0|s1|s2] on every tower, concatenated in tower order

Cost: every tower receives the other towers' rows, (n-1)·S_sparse bytes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import check_op
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import send

__all__ = ["densified", "densify", "gather_indexed_slices", "to_dense"]


def gather_indexed_slices(
    values: Sequence[tf.IndexedSlices], devices: Sequence[str], op: str = "sum"
) -> list[tf.IndexedSlices]:
    """All-gather sparse values in tower order onto each of ``devices`` (``op``: ``"sum"``,
    or ``"mean"``, which scales the gathered values by 1/n)."""
    if op not in ("sum", "mean"):
        raise ValueError(f"sparse values support op 'sum' or 'mean', got {op!r}")
    check_op(op, values[0].dtype)
    n, out = len(values), []
    for dst in devices:
        with tf.device(dst):
            parts = [send(v.values, dst, note="sparse-gather") for v in values]
            idx = [send(v.indices, dst, note="sparse-gather") for v in values]
            rows = tf.concat(parts, axis=0)
            if op == "mean":
                rows = rows / tf.constant(n, rows.dtype)
            out.append(tf.IndexedSlices(rows, tf.concat(idx, axis=0), values[0].dense_shape))
    return out


def densify(
    algorithm: Callable[..., list[tf.Tensor]],
    values: Sequence[tf.IndexedSlices],
    devices: Sequence[str],
    op: str = "sum",
) -> list[tf.Tensor]:
    """Convert each tower's slices to a dense tensor on its device, then all-reduce densely."""
    return algorithm(per_tower(devices, lambda i: to_dense(values[i])), op=op)


def to_dense(value: tf.IndexedSlices) -> tf.Tensor:
    """The dense sum of ``value``, keeping its static shape (chunking algorithms need it)."""
    dense = tf.convert_to_tensor(value)
    static = tf.get_static_value(value.dense_shape)
    if static is not None:
        dense.set_shape(static)  # convert_to_tensor leaves the gathered axis unknown
    return dense


def densified(grads: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """``grads[tower][var]`` with every sparse gradient made dense on its own device."""
    out = [list(row) for row in grads]
    for row in out:
        for k, g in enumerate(row):
            if isinstance(g, tf.IndexedSlices):
                with tf.device(g.values.device):
                    row[k] = to_dense(g)
    return out
