"""Replica agreement: every replica's copy of every variable, compared by checksum.

::

    replica r (on its device):  c[r][v] = (Σ_k b_k,  Σ_k (k+1)·b_k)   b = v's bits as integers
                 │  two int64 per variable come to the host
                 ▼
    host:  first v (model.weights order, then the optimizer's) with c[r][v] != c[0][v]
           → ReplicaMismatchError(v, [r …])

Replicated training keeps every copy bitwise equal only when every tower receives the
same reduced gradient. An all-reduce that does not (a non-reducing or buggy user
algorithm) lets the copies drift apart silently; PyTorch DDP verifies its parameters
across processes for the same reason. The checksum reads the raw bits (so it tells
0.0 from -0.0 and sees NaN payloads), weighted by position (so swapped elements
differ). It runs every ``check_replicas_every`` steps (``TowerTrainer``), outside the
step: the step's graph, and so its bits, are the same with the check on or off.
With ``variables="parameter_device"`` there is one copy and nothing to compare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers.guard.arguments import optional, positive_int
from towers.guard.errors import ReplicaMismatchError

__all__ = ["ReplicaCheck", "checksum"]

_BITS = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def checksum(value: tf.Tensor) -> tf.Tensor:
    """Two int64 of ``value``'s bits: their sum and their position-weighted sum."""
    if value.dtype.is_floating:
        bits = tf.bitcast(value, _BITS[value.dtype.size])
    else:
        bits = tf.cast(value, tf.int8) if value.dtype.is_bool else value
    bits = tf.reshape(tf.cast(bits, tf.int64), [-1])
    position = tf.range(1, tf.size(bits, out_type=tf.int64) + 1, dtype=tf.int64)
    return tf.stack([tf.reduce_sum(bits), tf.reduce_sum(bits * position)])


def _variables(replica: Any) -> list[tf.Variable]:
    # variables="sharded": each optimizer holds other slots (its own shard's); weights only
    state = [] if getattr(replica, "sharded", False) else replica.optimizer.variables
    return [*replica.model.weights, *state]


class ReplicaCheck:
    """Compare the replicas every ``every`` steps (None or 0: never).

    Raises:
        ValueError: ``every`` is not None or a positive int.
    """

    def __init__(self, every: int | None) -> None:
        optional(positive_int, "check_replicas_every", every)
        self.every, self.steps = every, 0
        self._sums: Any = None

    def after_step(self, replicas: Sequence[Any], algorithm: str) -> None:
        """Count a step; on every ``every``-th, :meth:`check` the replicas."""
        self.steps += 1
        if self.every and self.steps % self.every == 0:
            self.check(replicas, algorithm)

    def check(self, replicas: Sequence[Any], algorithm: str) -> None:
        """Raise when any replica's copy of a variable differs from replica 0's.

        Raises:
            ReplicaMismatchError: naming the first variable that differs and the replicas.
        """
        if len(replicas) < 2:
            return
        if self._sums is None:  # one graph for every replica's checksums, traced once
            self._sums = tf.function(lambda: [self._on(r) for r in replicas], autograph=False)
        sums = [np.asarray(s) for s in self._sums()]
        names = [getattr(v, "path", None) or v.name for v in _variables(replicas[0])]
        for j, name in enumerate(names):
            differ = [r for r in range(1, len(sums)) if (sums[r][j] != sums[0][j]).any()]
            if differ:
                step = int(replicas[0].optimizer.iterations)
                raise ReplicaMismatchError(step, name, differ, algorithm)

    @staticmethod
    def _on(replica: Any) -> tf.Tensor:
        with tf.device(replica.device):
            return tf.stack([checksum(tf.convert_to_tensor(v)) for v in _variables(replica)])
