"""Naive all-reduce: ``add_n`` on the first tower, then copy the sum back out.

The floor of every comparison and the order tf.distribute's
``ReductionToOneDevice`` uses::

    tick:      0 (gather)          1 (add_n)         2 (scatter)
    tower 0    x0 ────────────┐    s = x0+x1+x2+x3   s ──▶ out0
    tower 1    x1 ──▶ tower 0 │                      s ──▶ tower 1
    tower 2    x2 ──▶ tower 0 │                      s ──▶ tower 2
    tower 3    x3 ──▶ tower 0 ┘                      s ──▶ tower 3

Order: ``((x0 + x1) + x2) + ...`` — TensorFlow's CPU ``AddN`` kernel adds its
inputs left to right, so the sum is sequential in tower order.

Cost (n towers, S bytes): tower 0 receives (n-1)·S and sends (n-1)·S; every other
tower sends S. Time 2(n-1)·(α + Sβ) + (n-1)·Sγ: everything crosses tower 0.

References:
    TensorFlow ``cross_device_ops.ReductionToOneDevice``; d2l.ai "Multiple GPUs".
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values, combine, finish
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Algorithm, Coefficients, register, schedule_of

__all__ = ["NAIVE", "bytes_sent", "cost", "naive", "rooted_cost", "summation_depth"]


def naive_all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
    """Reduce everything on tower 0 (``add_n`` for sums), then copy the result to each tower.

    Example:
        >>> outs = naive([tf.ones([2]), tf.ones([2])])   # doctest: +SKIP

    ``naive`` is this function with its registry record (:data:`NAIVE`).
    """
    devices = check_values(values, op)
    root = devices[0]
    with tf.device(root):
        gathered = [send(v, root, tick=0, chunk=0, note="gather") for v in values]
        if op in ("sum", "mean") and len(gathered) > 1 and not _large(values[0]):
            total = tf.add_n(gathered)
        else:
            total = gathered[0]
            for g in gathered[1:]:
                total = combine(total, g, op)
        total = finish(total, op, len(values))
    return [send(total, d, tick=1, chunk=0, note="broadcast") for d in devices]


_CHAIN_ABOVE_BYTES = 16 * 2**20


def _large(x: tf.Tensor) -> bool:
    """Above ~16 MB TensorFlow's CPU ``AddN`` slows down (measured: 4.0 GB/s at 16 MB,
    2.0 GB/s at 64 MB) while a chain of two-input adds keeps 3.3 GB/s. Both add left to
    right, so the bits are the same."""
    size = x.shape.num_elements() if x.shape.is_fully_defined() else None
    return size is not None and size * x.dtype.size > _CHAIN_ABOVE_BYTES


def bytes_sent(n: int, nbytes: int, itemsize: int = 4) -> list[int]:
    """Bytes each tower sends: S from every tower to tower 0, then (n−1)·S back out."""
    return [(n - 1) * nbytes] + [nbytes] * (n - 1)


def summation_depth(n: int) -> int:
    """``add_n`` adds left to right: the last element goes through n − 1 additions."""
    return max(n - 1, 0)


def rooted_cost(n: int, nbytes: float, *, on_tower: bool = True) -> Coefficients:
    """Everything through one root's port: ``2m·(α + S·β) + (n-1)·S·γ``.

    ``m = n-1`` messages each way when the root is a tower (its own value stays),
    ``m = n`` for a separate device (parameter_device off the towers).
    """
    m = n - 1 if on_tower else n
    return 2 * m, 2 * m * nbytes, (n - 1) * nbytes


def cost(n: int, nbytes: float) -> Coefficients:
    """α-β-γ coefficients: :func:`rooted_cost` on a tower."""
    return rooted_cost(n, nbytes, on_tower=True)


def _build() -> AllReduce:
    return naive_all_reduce


NAIVE = register(
    Algorithm("naive", _build, bytes_sent, summation_depth, cost, schedule_of(__doc__))
)
naive = NAIVE()
"""The naive all-reduce (:func:`naive_all_reduce` with its record)."""
