"""All-reduce on TensorFlow's collective ops with ``communication_hint="nccl"``: the yardstick.

The ops are opaque (bytes are :func:`estimated_bytes_sent`). ``nccl()`` is one
``all_reduce_v2`` per tower (a ring on CPU; NCCL's ring or tree on GPUs; the raw
``nccl_ops.all_sum`` when every tower is its own physical GPU). The other two are
composed from collectives, n = 4 (rank: TensorFlow's, by task and device index)::

    nccl_ring  tick 0: all_to_all_v2          local             tick 1: all_gather_v2
    rank 0     row j → rank j; gets rows 0    c0 = Σ rows (+/n)  c0 → all; gets c1 c2 c3
    rank 1     row j → rank j; gets rows 1    c1 = Σ rows (+/n)  c1 → all; gets c0 c2 c3
    rank 2, 3  likewise (chunk r of the padded [n, ⌈L/n⌉] buffer reduced on rank r)
    (from 11 ranks tick 0 is pairwise send/recv: ``tf_collective_ops.all_to_all``)

    nccl_tree  tick 0     tick 1        tick 2 (broadcast_send/recv_v2)
    tower 0    ◀── t1     ◀── t2        s = finish(((x0+x1)+(x2+x3))) → t1 t2 t3
    tower 1    x1 → t0                  ◀── s
    tower 2    ◀── t3     x2+x3 → t0    ◀── s
    tower 3    x3 → t2                  ◀── s

Index formula (tree): at level k tower i with i mod 2^(k+1) = 2^k sends to i − 2^k.
Cost: nccl and nccl_ring the ring's; nccl_tree 2⌈log2 n⌉(α + Sβ) + ⌈log2 n⌉·Sγ.
Summation depth: n − 1 (nccl, nccl_ring), ⌈log2 n⌉ (nccl_tree).

References:
    NVIDIA NCCL; nccl-tests' bus bandwidth; TensorFlow
    ``cross_device_utils.CollectiveReplicaLauncher`` (ordering tokens, keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import collective_ops, nccl_ops

from towers.allreduce.machinery import tf_collective_ops as tco
from towers.allreduce.machinery.base import AllReduce, check_values, combine, finish
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import record_estimate
from towers.allreduce.machinery.registry import Algorithm, Coefficients, register, schedule_of
from towers.allreduce.machinery.tf_collective_ops import HINT, Body, group_key, next_key, token
from towers.allreduce.ring import cost as ring_cost
from towers.devices import has_gpu
from towers.guard.arguments import non_negative_float, positive_float, positive_int

__all__ = ["TIMEOUT_SECONDS", "differentiable", "estimated_bytes_sent", "nccl", "nccl_ring",
           "nccl_tree", "raw_nccl_usable"]

TIMEOUT_SECONDS = 60.0
"""Default deadline of a call (or a step): a missing peer becomes an error, not a hang."""


def raw_nccl_usable(devices: Sequence[str], dtype: tf.DType) -> bool:
    """True when ``nccl_ops`` can run: every device a GPU, one per physical GPU, a NCCL dtype."""
    kinds = {tf.DeviceSpec.from_string(d).device_type for d in devices}
    if kinds != {"GPU"} or not has_gpu():
        return False
    one_rank_per_gpu = len(tf.config.list_logical_devices("GPU")) == len(
        tf.config.list_physical_devices("GPU")
    )  # NCCL refuses two ranks on one physical GPU (logical GPUs split from one)
    return one_rank_per_gpu and dtype in (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _all_reduce_ops(
    values: list[tf.Tensor], devices: Sequence[str], op: str, group_size: int
) -> list[tf.Tensor]:
    """One all_reduce_v2 per tower (``group_size`` > len(values) only to test timeouts)."""
    group, instance = group_key(devices, group_size), next_key()
    merge = {"max": "Max", "min": "Min", "product": "Mul"}.get(op, "Add")
    return per_tower(devices, lambda i: collective_ops.all_reduce_v2(
        values[i], group_size, group, instance, merge_op=merge,
        final_op="Div" if op == "mean" else "Id", communication_hint=HINT,
        ordering_token=token(devices[i])))


def _nccl_body(values: list[tf.Tensor], devices: tuple[str, ...], op: str) -> list[tf.Tensor]:
    if not raw_nccl_usable(devices, values[0].dtype):
        return _all_reduce_ops(values, devices, op, len(values))
    reduce = {"max": nccl_ops.all_max, "min": nccl_ops.all_min,
              "product": nccl_ops.all_prod}.get(op, nccl_ops.all_sum)
    outs = reduce(values)  # correctly rounded: identical sums give identical means
    return per_tower(devices, lambda i: finish(outs[i], op, len(values)))


def _ring_body(values: list[tf.Tensor], devices: tuple[str, ...], op: str) -> list[tf.Tensor]:
    """Reduce-scatter as all-to-all + a local sum, then all-gather; chunk r finished once."""
    n, shape, dtype = len(values), values[0].shape, values[0].dtype
    length = int(shape.num_elements())
    chunk = -(-length // n)
    rows = per_tower(devices, lambda i: tf.reshape(
        tf.pad(tf.reshape(values[i], [-1]), [[0, n * chunk - length]]), [n, chunk]))
    received_rows = tco.all_to_all(rows, devices)
    group, gather_key, outputs = group_key(devices), next_key(), []
    for received, device in zip(received_rows, devices, strict=True):
        with tf.device(device):
            parts = tf.unstack(received)
            reduced = parts[0]
            for part in parts[1:]:
                reduced = combine(reduced, part, op)
            full = collective_ops.all_gather_v2(
                tco.wire(finish(reduced, op, n)), n, group, gather_key, communication_hint=HINT,
                ordering_token=token(device))
            outputs.append(tf.reshape(tco.unwire(full, dtype)[:length], shape))
    return outputs


def _tree_body(values: list[tf.Tensor], devices: tuple[str, ...], op: str) -> list[tf.Tensor]:
    """Binomial-tree reduce onto tower 0 (groups of two), then one broadcast to all."""
    n, shape = len(values), values[0].shape
    acc = per_tower(devices, lambda i: tf.reshape(values[i], [-1]))
    step = 1
    while step < n:
        for dst in range(0, n - step, 2 * step):
            sent, (got,) = tco.broadcast_send_recv(
                acc[dst + step], devices[dst + step], [devices[dst]])
            # The control edge keeps the send alive: auto control deps may prune it.
            with tf.device(devices[dst]), tf.control_dependencies([sent]):
                acc[dst] = combine(acc[dst], got, op)
        step *= 2
    with tf.device(devices[0]):
        total = finish(acc[0], op, n)
    sent, received = tco.broadcast_send_recv(total, devices[0], devices[1:])
    outputs = []
    # Every output waits for every op of the broadcast: a caller that uses only some
    # outputs (the parameter-device placement keeps output 0) must not let the unused
    # receives be pruned, or the send waits for them until the deadline.
    everyone = [sent, *received]
    for device, flat in zip(devices, everyone, strict=True):
        with tf.device(device), tf.control_dependencies(everyone):
            outputs.append(tf.reshape(flat, shape))
    return outputs


def differentiable(algorithm: AllReduce) -> AllReduce:
    """``algorithm`` with a gradient, computed by ``algorithm`` itself (TensorFlow registers
    none for its collective ops; ``dy_i``: output ``i``'s upstream gradient, ``x_j``: tower
    ``j``'s value, ``y``: the reduction; integer values have no gradient)::

        op         gradient to tower j                       backward collective
        sum        Σ_i dy_i                                  all-reduce sum of the dy
        mean       (Σ_i dy_i) / n                            all-reduce mean of the dy
        max, min   Σ_i dy_i · [x_j = y] / #{k : x_k = y}     all-reduce sum of (dy, [x = y])
        product    Σ_i dy_i · Π_{k≠j} x_k                    all-reduce sum of (x in row k, dy)

    ``max``/``min`` follow ``tf.reduce_max``'s gradient (tied towers split it), ``product``
    ``tf.reduce_prod``'s.
    """

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
    """The gradient to each tower (:func:`differentiable`'s table), placed on its device."""
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


def _factory(body: Body, name: str, timeout_seconds: float = TIMEOUT_SECONDS) -> AllReduce:
    """Build ``nccl``, ``nccl_ring`` or ``nccl_tree``; ``timeout_seconds`` bounds an eager call
    (and a trainer's step without ``step_timeout``)."""
    positive_float("timeout_seconds", timeout_seconds)

    def all_reduce(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        outputs = tco.run(body, values, op, timeout_seconds)  # checks values: static shapes
        n = len(values)  # tell any active record() what the opaque ops are expected to send
        nbytes = int(values[0].shape.num_elements()) * values[0].dtype.size
        for i, sent in enumerate(estimated_bytes_sent(n, nbytes) if n > 1 else []):
            record_estimate(values[i].device, values[(i + 1) % n].device, round(sent),
                            note=f"{n}-way collective")
        return outputs

    all_reduce.__name__ = all_reduce.__qualname__ = f"{name}_all_reduce"
    return differentiable(all_reduce)  # TensorFlow has no gradient for collective ops


def estimated_bytes_sent(n: int, nbytes: int) -> list[float]:
    """An ESTIMATE of bytes each tower sends: NCCL's ring figure 2(n−1)/n·S (nccl-tests)."""
    positive_int("n", n)
    non_negative_float("nbytes", nbytes)
    return [2 * (n - 1) / n * nbytes] * n


def _tree_cost(n: int, nbytes: float) -> Coefficients:
    d = (n - 1).bit_length()  # binomial levels: one message per tower per level, each way
    return 2 * d, 2 * d * nbytes, d * nbytes


def _register(name: str, body: Body, depth: Any, cost: Any) -> Algorithm:
    return register(Algorithm(name, partial(_factory, body, name),
                              lambda n, nbytes, itemsize, **_: estimated_bytes_sent(n, nbytes),
                              lambda n, **_: depth(n), cost,
                              schedule_of(__doc__), estimated=True, replayable=False))


nccl = _register("nccl", _nccl_body, lambda n: max(n - 1, 0), ring_cost)
nccl_ring = _register("nccl_ring", _ring_body, lambda n: max(n - 1, 0), ring_cost)
nccl_tree = _register("nccl_tree", _tree_body, lambda n: (n - 1).bit_length(), _tree_cost)
