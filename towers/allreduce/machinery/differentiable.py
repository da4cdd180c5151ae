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

__all__ = ["differentiable"]


def differentiable(algorithm: AllReduce) -> AllReduce:
    """``algorithm`` with the gradient above (computed by ``algorithm`` itself)."""

    def all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        devices = check_values(values, op)
        if not values[0].dtype.is_floating:
            return algorithm(values, op=op)
        xs = []
        for v, device in zip(values, devices, strict=True):
            with tf.device(device):  # a variable's value: the tape watches the read
                xs.append(tf.convert_to_tensor(v))

        @tf.custom_gradient
        def forward(*xs: tf.Tensor) -> tuple[list[tf.Tensor], object]:
            stopped = []
            for x, device in zip(xs, devices, strict=True):
                with tf.device(device):  # the tape must not look inside (no gradients there)
                    stopped.append(tf.stop_gradient(x))
            outs = algorithm(stopped, op=op)

            def backward(*dys: tf.Tensor) -> list[tf.Tensor]:
                return _gradient(algorithm, list(xs), outs, list(dys), devices, op)

            return outs, backward

        with tf.device(devices[0]):
            joined = forward(*xs)
        outputs = []
        for y, device in zip(joined, devices, strict=True):
            with tf.device(device):
                outputs.append(tf.identity(y))
        return outputs

    all_reduce.__name__ = all_reduce.__qualname__ = getattr(
        algorithm, "__name__", "all_reduce")
    return all_reduce


def _gradient(algorithm: AllReduce, xs: list[tf.Tensor], ys: list[tf.Tensor],
              dys: list[tf.Tensor | None], devices: list[str], op: str) -> list[tf.Tensor]:
    """The gradient to each tower (the module docstring's table), placed on its device."""
    upstream = []
    for x, dy, device in zip(xs, dys, devices, strict=True):
        with tf.device(device):
            upstream.append(tf.zeros_like(x) if dy is None else tf.identity(dy))
    if op in ("sum", "mean"):
        return list(algorithm(upstream, op=op))
    if op == "product":
        return _product_gradient(algorithm, xs, upstream, devices)
    pairs = []
    for x, y, dy, device in zip(xs, ys, upstream, devices, strict=True):
        with tf.device(device):
            pairs.append(tf.stack([dy, tf.cast(tf.equal(x, y), dy.dtype)]))
    grads = []
    for total, x, y, device in zip(algorithm(pairs, op="sum"), xs, ys, devices, strict=True):
        with tf.device(device):
            indicator = tf.cast(tf.equal(x, y), total.dtype)
            grads.append(indicator / total[1] * total[0])  # tf.reduce_max's order
    return grads


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
