"""The replicas checked against replica 0 (``check_replicas_every``): every k steps, a
checksum of each variable's raw bits on each replica; the first that differs raises
:class:`~towers.guard.errors.ReplicaMismatchError`.
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
    """Compare the replicas every ``every`` steps (None: never; else a positive int)."""

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
        """Raises ReplicaMismatchError naming the first variable a replica holds other
        bits of than replica 0, and the replicas."""
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
