"""Naive all-reduce: ``add_n`` on the first tower, then copy the sum back out.

The floor of every comparison, in tf.distribute's ``ReductionToOneDevice`` order::

    tick:      0 (gather)          1 (add_n)         2 (scatter)
    tower 0    x0 ────────────┐    s = x0+x1+x2+x3   s ──▶ out0
    tower 1    x1 ──▶ tower 0 │                      s ──▶ tower 1
    tower 2    x2 ──▶ tower 0 │                      s ──▶ tower 2
    tower 3    x3 ──▶ tower 0 ┘                      s ──▶ tower 3

Order: ``((x0 + x1) + x2) + ...`` (CPU ``AddN`` adds left to right). Cost: that of
:mod:`towers.allreduce.parameter_device` on tower 0, 2(n-1)·(α + Sβ) + (n-1)·Sγ.

References:
    TensorFlow ``cross_device_ops.ReductionToOneDevice``; d2l.ai "Multiple GPUs".
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import check_values, finish
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Algorithm, register, schedule_of
from towers.allreduce.parameter_device import bytes_sent, cost, reduce_on, summation_depth

__all__ = ["naive", "noop"]


def naive_all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Reduce everything on tower 0 (``add_n`` for sums), then copy the result to each tower."""
    devices = check_values(values, op)
    root = devices[0]
    size = values[0].shape.num_elements()  # None: not static
    # Above ~16 MB a chain of two-input adds beats TensorFlow's CPU AddN; both add left to
    # right, so the bits are the same.
    large = size is not None and size * values[0].dtype.size > 16 * 2**20
    with tf.device(root):
        if op in ("sum", "mean") and len(values) > 1 and not large:
            total = tf.add_n([send(v, root, tick=0, chunk=0, note="gather") for v in values])
        else:  # the same left fold, one add at a time (max and min too)
            total = reduce_on(values, root, op, note="gather")
        total = finish(total, op, len(values))
    return [send(total, d, tick=1, chunk=0, note="broadcast") for d in devices]


naive = register(Algorithm("naive", lambda: naive_all_reduce, bytes_sent, summation_depth, cost,
                           schedule_of(__doc__)))()
"""The naive all-reduce (:func:`naive_all_reduce` with its record)."""


def noop(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """No exchange at all: every tower keeps its own value (a ceiling for benchmarks, not a sum)."""
    check_values(values, op)
    return list(values)
