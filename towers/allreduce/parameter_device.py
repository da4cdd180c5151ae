"""Parameter-device all-reduce: reduce on one chosen device in tower order, then broadcast.

The classic parameter-server step (tf_cnn_benchmarks' ``parameter_server``,
``CentralStorageStrategy``): every tower ships its value to the parameter device
``p``, which adds them in tower order and sends the result back::

    tick:       0 (to p)                 1 (reduce on p)            2 (from p)
    tower 0     x0 ──▶ p                 p: s = x0                  s ──▶ tower 0
    tower 1     x1 ──▶ p                 p: s = s + x1              s ──▶ tower 1
    tower 2     x2 ──▶ p                 p: s = s + x2              s ──▶ tower 2
    tower 3     x3 ──▶ p                 p: s = s + x3              s ──▶ tower 3

Order: ``((x0 + x1) + x2) + x3``, one add at a time, so max and min work too.
When ``p`` is itself a tower its own value is not sent.

Cost (n towers, S bytes): p receives n·S and sends n·S (less one S each when p is
a tower); 2·(α + n·Sβ) + (n-1)·Sγ with p's link as the bottleneck.

References:
    Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values, combine, finish
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import (
    Algorithm,
    Coefficients,
    Configured,
    register,
    schedule_of,
)
from towers.devices import canonical_device

__all__ = ["PARAMETER_DEVICE", "bytes_sent", "cost", "parameter_device", "reduce_on",
           "summation_depth"]


def reduce_on(values: Sequence[tf.Tensor], device: str, op: str, *,
              note: str = "to-parameter-device") -> tf.Tensor:
    """Combine ``values`` on ``device`` one at a time in tower order (not finished):
    ``((x0 ⊕ x1) ⊕ x2) ⊕ …``, each sent there at tick 0 (value ``i`` labelled chunk ``i``)."""
    with tf.device(device):
        total = send(values[0], device, tick=0, chunk=0, note=note)
        for i, v in enumerate(values[1:], start=1):
            total = combine(total, send(v, device, tick=0, chunk=i, note=note), op)
    return total


def _build(device: str | None = None) -> AllReduce:
    chosen = canonical_device(device) if device else None

    def parameter_device_all_reduce(
        values: Sequence[tf.Tensor], *, op: str = "sum"
    ) -> list[tf.Tensor]:
        devices = check_values(values, op)
        p = chosen or devices[0]
        with tf.device(p):
            total = finish(reduce_on(values, p, op), op, len(values))
        return [send(total, d, tick=1, chunk=0, note="broadcast") for d in devices]

    return parameter_device_all_reduce


def parameter_device(device: str | None = None) -> Configured:
    """Build the parameter-device all-reduce that reduces on ``device`` (default: tower 0's).

    Args:
        device: where the sum is formed; need not be one of the towers.

    Example:
        >>> outs = parameter_device("/device:CPU:7")(values, op="mean")   # doctest: +SKIP
    """
    return PARAMETER_DEVICE(device=canonical_device(device) if device else None)


def bytes_sent(n: int, nbytes: int, itemsize: int, device: str | None = None) -> list[int] | None:
    """Bytes each tower sends when tower 0 is the parameter device: (n−1)·S out, S in.

    On another device the sends depend on whether it is a tower: None (not known here).
    """
    if device is not None:
        return None
    return [(n - 1) * nbytes] + [nbytes] * (n - 1)


def summation_depth(n: int, device: str | None = None) -> int:
    """One addition at a time in tower order: n − 1 additions for the last value."""
    return max(n - 1, 0)


def cost(n: int, nbytes: float, *, on_tower: bool = True) -> Coefficients:
    """α-β-γ coefficients, everything through one port: ``2m·(α + S·β) + (n-1)·S·γ``, with
    ``m = n-1`` messages each way on a tower (its own value stays), else ``m = n``."""
    m = n - 1 if on_tower else n
    return 2 * m, 2 * m * nbytes, (n - 1) * nbytes


PARAMETER_DEVICE = register(
    Algorithm("parameter_device", _build, bytes_sent, summation_depth, cost, schedule_of(__doc__))
)
