"""Dynamic loss scaling across towers: one finite decision, every replica's scale moves as one.

::

    tower i:  loss_i ──× S ──▶ tape ──▶ S·g_i           S: the replica's dynamic_scale
                │  guard code bit 2: S·g_i non-finite (local, before any reduction)
                ▼
    all-reduce  Σ_i S·g_i      in reduce_dtype ("float32", or "compute": the policy's)
                │
    parameter device:  finite = all_i(code_i & 2 == 0) ∧ isfinite(Σ_i S·g_i)   ONE flag
                │
    every replica: tf.cond(finite,
        apply Σ S·g_i / S;  counter == growth − 1 ? (S ← 2S, counter ← 0) : counter += 1,
        S ← S / 2;  counter ← 0)              weights, slots, iterations untouched

Keras 3's ``LossScaleOptimizer`` rule with one finite flag for the whole step (Keras under
``MirroredStrategy`` decides from replica 0's unreduced gradients: docs/mixed_precision.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.allreduce.machinery.primitives import send

__all__ = ["REDUCE_DTYPES", "LossScale", "is_loss_scaled"]

REDUCE_DTYPES = ("float32", "compute")
"""``TowerTrainer(reduce_dtype=...)``: the dtype gradients are summed in."""

ApplyFn = Callable[[keras.optimizers.Optimizer, list[Any]], None]


def is_loss_scaled(optimizer: Any) -> bool:
    """True for a Keras ``LossScaleOptimizer`` (dynamic loss scaling)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)


def _values(fn: Callable[[tf.Tensor], tf.Tensor], value: Any) -> Any:
    """``fn`` applied to a dense value, or to the values of an ``IndexedSlices``."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(fn(value.values), value.indices, value.dense_shape)
    return fn(value)


def _cast(value: Any, dtype: tf.DType) -> Any:
    """``value`` (dense, sparse or None) in ``dtype``, cast on its own device."""
    if value is None or value.dtype == dtype or not value.dtype.is_floating:
        return value
    with tf.device(value.device):
        return _values(lambda v: tf.cast(v, dtype), value)


def all_finite(values: Sequence[Any]) -> tf.Tensor:
    """One boolean: every element of every (dense or sparse) value is finite."""
    dense = [v.values if isinstance(v, tf.IndexedSlices) else v for v in values]
    flags = [tf.reduce_all(tf.math.is_finite(v)) for v in dense if v.dtype.is_floating]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


class LossScale:
    """A trainer's loss-scaling and reduction-dtype rules.

    Args:
        optimizer: the first replica's optimizer; a ``LossScaleOptimizer`` turns scaling on.
        model: the first replica's model; its ``dtype_policy`` gives the compute dtype.
        reduce_dtype: ``"float32"`` (each gradient in its own dtype, at least float32) or
            ``"compute"`` (the policy's compute dtype: a sum overflowing there is non-finite).
    """

    def __init__(self, optimizer: Any, model: keras.Model, reduce_dtype: str = "float32") -> None:
        self.active, self.reduce_dtype = is_loss_scaled(optimizer), reduce_dtype
        compute = tf.as_dtype(model.dtype_policy.compute_dtype)
        self.compute_dtype = compute if compute.is_floating else tf.float32
        # whether to_wire may change a gradient of this model (else the wire is the identity)
        floats = {d for d in map(tf.as_dtype, {v.dtype for v in model.variables}) if d.is_floating}
        self.casts = any(self.wire_dtype(d) != d for d in floats)

    def scale(self, optimizer: Any, src: str, device: str) -> tf.Tensor | None:
        """The replica's current scale ``S`` on ``device`` (None without loss scaling)."""
        if not self.active:
            return None
        with tf.device(src):
            value = tf.convert_to_tensor(optimizer.dynamic_scale.value)
        return send(value, device, src=src, note="loss-scale")

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        """The dtype a gradient of ``dtype`` is summed in."""
        if self.reduce_dtype == "compute":
            return self.compute_dtype
        return dtype if dtype.size >= 4 else tf.float32

    def to_wire(self, grads: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """``grads[tower][var]`` in the dtype they are summed in (on their devices)."""
        return [[_cast(g, self.wire_dtype(g.dtype)) for g in tower] for tower in grads]

    def from_wire(self, reduced: Sequence[Sequence[Any]], dtypes: Sequence[Any]) -> list[list[Any]]:
        """The reduced gradients back in their variables' dtypes (None: an empty shard)."""
        return [[_cast(g, tf.as_dtype(d)) for g, d in zip(row, dtypes)] for row in reduced]

    def finite(self, reduced: Sequence[Any], local: tf.Tensor | None, device: str) -> tf.Tensor:
        """The step's one flag: the towers' local gradients (``local``, the guard's) and
        the reduced ones (a sum can overflow where no addend did) are all finite."""
        src = reduced[0].device  # check where the sums are, send one boolean
        with tf.device(src):
            flag = all_finite(reduced)
        flag = send(flag, device, src=src, note="loss-scale")
        with tf.device(device):
            return flag if local is None else tf.logical_and(local, flag)

    def apply(self, optimizer: Any, grads: list[Any], finite: tf.Tensor | None,
              apply: ApplyFn) -> None:
        """Apply one replica's reduced gradients (``S·Σg`` when loss-scaled) with the step's
        own ``apply(optimizer, grads)`` under the dynamic-scale rule and :meth:`finite`'s flag."""
        if not self.active:
            apply(optimizer, grads)
            return
        scale = tf.convert_to_tensor(optimizer.dynamic_scale.value)

        def finite_step() -> tf.Tensor:
            unscaled = [_values(lambda v: v / tf.cast(scale, v.dtype), g) for g in grads]
            apply(optimizer.inner_optimizer, unscaled)
            grow = tf.equal(optimizer.step_counter, optimizer.dynamic_growth_steps - 1)
            tf.cond(grow, lambda: _set(optimizer, 2.0, 0), lambda: _count(optimizer))
            return tf.constant(True)

        def overflow_step() -> tf.Tensor:
            _set(optimizer, 0.5, 0)
            return tf.constant(False)

        if finite is None:
            finite = all_finite(grads)
        tf.cond(finite, finite_step, overflow_step)


def _set(optimizer: Any, factor: float, counter: int) -> tf.Tensor:
    optimizer.step_counter.assign(counter)
    optimizer.dynamic_scale.assign(optimizer.dynamic_scale * factor)
    return tf.constant(True)


def _count(optimizer: Any) -> tf.Tensor:
    optimizer.step_counter.assign_add(1)
    return tf.constant(True)
