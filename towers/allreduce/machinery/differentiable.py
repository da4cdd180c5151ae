"""A gradient for an all-reduce whose ops TensorFlow cannot differentiate.

TensorFlow registers no gradient for its collective ops (:mod:`towers.allreduce.nccl`);
:func:`differentiable` computes it with the same algorithm (``dy_i``: output ``i``'s
upstream gradient; ``x_j``: tower ``j``'s value; ``y``: the reduction)::

    op         gradient to tower j                       backward collective
    sum        Σ_i dy_i                                  all-reduce sum of the dy
    mean       (Σ_i dy_i) / n                            all-reduce mean of the dy
    max, min   Σ_i dy_i · [x_j = y] / #{k : x_k = y}     all-reduce sum of (dy, [x = y])
    product    Σ_i dy_i · Π_{k≠j} x_k                    all-reduce sum of (x in row k, dy)

``max``/``min`` follow ``tf.reduce_max``'s gradient (tied towers split it), ``product``
``tf.reduce_prod``'s. Integer values have no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values
from towers.allreduce.machinery.packed import per_tower

__all__ = ["differentiable"]


def differentiable(algorithm: AllReduce) -> AllReduce:
    """``algorithm`` with the gradient above (computed by ``algorithm`` itself)."""

    def all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        devices = check_values(values, op)
        if not values[0].dtype.is_floating:
            return algorithm(values, op=op)
        # a variable's value: the tape watches the read
        xs = per_tower(devices, lambda i: tf.convert_to_tensor(values[i]))

        @tf.custom_gradient
        def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], object]:
            # the tape must not look inside (no gradients there)
            outs = algorithm(per_tower(devices, lambda i: tf.stop_gradient(xs[i])), op=op)

            def backward(*dys: tf.Tensor) -> list[tf.Tensor]:
                return _gradient(algorithm, list(xs), outs, list(dys), devices, op)

            return outs, backward

        with tf.device(devices[0]):
            joined = forward(*xs)
        return per_tower(devices, lambda i: tf.identity(joined[i]))

    all_reduce.__name__ = all_reduce.__qualname__ = getattr(
        algorithm, "__name__", "all_reduce")
    return all_reduce


def _gradient(algorithm: AllReduce, xs: list[tf.Tensor], ys: list[tf.Tensor],
              dys: list[tf.Tensor | None], devices: list[str], op: str) -> list[tf.Tensor]:
    """The gradient to each tower (the module docstring's table), placed on its device."""
    upstream = per_tower(devices, lambda i: tf.zeros_like(xs[i]) if dys[i] is None
                         else tf.identity(dys[i]))
    if op in ("sum", "mean"):
        return list(algorithm(upstream, op=op))
    if op == "product":
        return _product_gradient(algorithm, xs, upstream, devices)
    pairs = per_tower(devices, lambda i: tf.stack(
        [upstream[i], tf.cast(tf.equal(xs[i], ys[i]), upstream[i].dtype)]))
    totals = algorithm(pairs, op="sum")
    return per_tower(devices, lambda i: (  # tf.reduce_max's order
        tf.cast(tf.equal(xs[i], ys[i]), totals[i].dtype) / totals[i][1] * totals[i][0]))


def _product_gradient(algorithm: AllReduce, xs: list[tf.Tensor], upstream: list[tf.Tensor],
                      devices: list[str]) -> list[tf.Tensor]:
    """``tf.reduce_prod``'s gradient over the stacked towers: every tower's value reaches
    every tower as row ``k`` of a sum (the other rows zero), the summed ``dy`` as row n."""
    n, rows = len(xs), []
    for k, (x, dy, device) in enumerate(zip(xs, upstream, devices, strict=True)):
        with tf.device(device):
            zero = tf.zeros_like(x)
            rows.append(tf.stack([x if i == k else zero for i in range(n)] + [dy]))
    grads = []
    for k, (total, device) in enumerate(zip(algorithm(rows, op="sum"), devices, strict=True)):
        with tf.device(device):
            values = total[:n]
            before = tf.math.cumprod(values, axis=0, exclusive=True)
            after = tf.math.cumprod(values, axis=0, exclusive=True, reverse=True)
            grads.append((before[k] * after[k]) * total[n])
    return grads
