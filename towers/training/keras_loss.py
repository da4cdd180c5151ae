"""A Keras loss as ``compile`` prepares it, one value per example, for the towers' step.

Cut where the towers need it: per example, before the global divisor (towers/tower.py
divides every tower's weighted sum by it)::

    loss given   "hinge" | "ce" | keras.losses.Loss | fn(y_true, y_pred)   resolve_loss
    labels       brought to the output's rank, as Keras wraps a loss       same_rank
    values       l[b, t…] · w[b, t…] ──▶ mean over t… (sum for "sum")      per_example_loss
    divisor      B, 1 ("sum") or Σw ("mean_with_sample_weight")            loss_divisor
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.allreduce.machinery.primitives import send

__all__ = ["CROSSENTROPY", "REDUCTIONS", "LossFn", "extra_axes", "loss_divisor", "loss_reduction",
           "per_example_loss", "resolve_loss", "same_rank", "tower_divisor", "weighs_elements"]

LossFn = Callable[[Any, Any], Any]

REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")
"""The Keras loss reductions a trainer honours, each over the *global* batch:
``sum_over_batch_size`` (the default), ``mean`` and ``"none"``/None: ``Σ w·l / B``; ``sum``:
``Σ w·l``; ``mean_with_sample_weight``: ``Σ w·l / Σ w`` (``Σ w·l / B`` without weights)."""


def resolve_loss(loss: str | LossFn | keras.losses.Loss) -> LossFn:
    """Turn a loss name, Keras loss or callable into ``(y_true, y_pred) -> per-example losses``.

    Raises:
        TypeError: ``loss`` is neither a name nor a callable.
        ValueError: an unknown loss name.
    """
    if isinstance(loss, str) and loss.lower() in CROSSENTROPY:
        return _crossentropy
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError as err:
            raise ValueError(f"loss: unknown Keras loss name {loss!r}") from err
    if isinstance(loss, keras.losses.Loss):
        # Loss.call gives the unreduced values; __call__ would average them.
        return loss.call
    if not callable(loss):
        raise TypeError(f"loss must be a Keras loss, a loss name or a callable; got {loss!r}")
    return same_rank(loss)


CROSSENTROPY = ("crossentropy", "ce")
"""Keras ``compile``'s loss aliases whose loss depends on the shapes (:func:`_crossentropy`)."""


def _crossentropy(y_true: Any, y_pred: Any) -> Any:
    """``loss="crossentropy"``/``"ce"``: binary for one output unit, sparse categorical for
    labels of a lower rank or one column, else categorical (Keras's ``compile`` rule)."""
    y_true, y_pred = tf.convert_to_tensor(y_true), tf.convert_to_tensor(y_pred)
    true, pred = y_true.shape, y_pred.shape
    if pred[-1] == 1:
        fn = keras.losses.binary_crossentropy
    elif true.rank < pred.rank or (true[-1] == 1 and pred[-1] > 1):
        fn = keras.losses.sparse_categorical_crossentropy
    else:
        fn = keras.losses.categorical_crossentropy
    return same_rank(fn)(y_true, y_pred)


def same_rank(fn: LossFn) -> LossFn:
    """``fn`` with ``y_true`` squeezed or expanded to ``y_pred``'s rank first, as Keras's
    ``LossFunctionWrapper`` does: labels ``(B,)`` against outputs ``(B, 1)`` would otherwise
    broadcast to ``(B, B)``."""

    @functools.wraps(fn)
    def call(y_true: Any, y_pred: Any) -> Any:
        if hasattr(y_true, "shape") and hasattr(y_pred, "shape"):
            y_true, y_pred = tf.convert_to_tensor(y_true), tf.convert_to_tensor(y_pred)
            t, p = y_true.shape.rank, y_pred.shape.rank
            if t is not None and p is not None:
                if t + 1 == p and y_pred.shape[-1] == 1:
                    if t == 1:
                        y_true = tf.expand_dims(y_true, -1)
                    else:
                        y_pred = tf.squeeze(y_pred, -1)
                elif t == p + 1 and y_true.shape[-1] == 1:
                    if p == 1:
                        y_pred = tf.expand_dims(y_pred, -1)
                    else:
                        y_true = tf.squeeze(y_true, -1)
        return fn(y_true, y_pred)

    return call


def loss_reduction(loss: str | LossFn | keras.losses.Loss) -> str:
    """The reduction a loss asks for (a Keras ``Loss``'s ``reduction``, ``"none"`` meaning the
    default; the default for any other loss).

    Raises:
        ValueError: a reduction not in :data:`REDUCTIONS`, naming ``loss`` and the reduction.
    """
    if isinstance(loss, str):
        loss = None if loss.lower() in CROSSENTROPY else keras.losses.get(loss)
    if not isinstance(loss, keras.losses.Loss):
        return REDUCTIONS[0]
    reduction = loss.reduction
    if reduction is None or reduction == "none":
        return REDUCTIONS[0]
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"loss: {type(loss).__name__} has reduction={reduction!r}, which towers does not "
            f"support; use one of {', '.join(REDUCTIONS)}"
        )
    return str(reduction)


def loss_divisor(
    reduction: str, global_batch: tf.Tensor, sample_weights: Sequence[Any], device: str
) -> tf.Tensor:
    """What every tower divides its weighted loss sum by: the global batch size (int32),
    1 for ``sum``, or the sample weights' global sum for ``mean_with_sample_weight`` (float32,
    formed on ``device`` in tower order)."""
    if reduction == "sum":
        return tf.ones([], global_batch.dtype)
    weights = [w for w in sample_weights if w is not None]
    if reduction != "mean_with_sample_weight" or not weights:
        return global_batch
    with tf.device(device):
        parts = [tf.cast(send(w, device, note="loss"), tf.float32) for w in weights]
        total = tf.reduce_sum(tf.concat([tf.reshape(w, [-1]) for w in parts], 0))
        if weighs_elements(weights[0]):  # per_example_loss averaged w·l over these axes
            total = total / tf.cast(tf.reduce_prod(tf.shape(weights[0])[1:]), tf.float32)
        return total


def tower_divisor(rule: str | float, divisor: tf.Tensor, shard: Any, towers: int) -> tf.Tensor:
    """What one tower divides its loss sum by, for ``rule``
    (:attr:`~towers.guard.options.TowerOptions.divisor`): the global ``divisor``
    (``"global"``), ``shard size × towers`` (``"per_replica"``), or the constant (int32 when
    whole, as ``compute_average_loss`` takes it)."""
    if rule == "per_replica":
        size = tf.shape(tf.nest.flatten(shard[0])[0])[0]  # compute_average_loss's shape[0]
        return size * towers
    if rule == "global":
        return divisor
    constant = float(rule)
    if constant.is_integer():
        return tf.constant(int(constant), tf.int32)
    return tf.constant(constant, tf.float32)


def per_example_loss(
    loss_fn: LossFn, y_true: Any, y_pred: Any, sample_weight: Any = None, *,
    extra_axes: str = "mean",
) -> tf.Tensor:
    """Per-example losses, shape ``[batch]``: extra axes (per timestep, per pixel) averaged
    (``extra_axes="mean"``) or added (``"sum"``, Keras's reduction ``"sum"``). A weight per
    element (:func:`weighs_elements`) is applied here, before that, as Keras applies it; a
    per-example weight is the caller's.

    Raises:
        ValueError: values that break :func:`_checked_values`'s contract; an element
            weight whose shape is not the values'.
    """
    values = _checked_values(loss_fn(y_true, y_pred), y_pred)
    if weighs_elements(sample_weight):
        weight = tf.convert_to_tensor(sample_weight)
        if weight.shape.rank != values.shape.rank or not weight.shape[1:].is_compatible_with(
                values.shape[1:]):  # fmt: skip
            raise ValueError(
                f"sample_weight of shape {weight.shape.as_list()} weighs the loss's elements, "
                f"but the loss values have shape {values.shape.as_list()}: give one weight "
                "per example (shape [batch]) or one per loss value (as Keras takes a "
                "per-timestep weight for a sequence loss)")  # fmt: skip
        values = values * tf.cast(weight, values.dtype)
    if values.shape.rank is not None and values.shape.rank > 1:
        reduce = tf.reduce_sum if extra_axes == "sum" else tf.reduce_mean
        values = reduce(values, axis=list(range(1, values.shape.rank)))
    return values


def _checked_values(values: Any, y_pred: Any) -> tf.Tensor:
    """A loss's output, checked when traced: floating values, one row per example of
    ``y_pred`` (its first leaf), so a loss averaged over the batch or broadcast against the
    outputs is not trained on silently.

    Raises:
        ValueError: a scalar, a non-floating dtype, or a first axis that is not the batch.
    """
    try:
        values = tf.convert_to_tensor(values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"loss must return a tensor of per-example values; got {values!r}"
                         ) from err  # fmt: skip
    if values.shape.rank == 0:
        raise ValueError(
            "loss must return one value per example (shape [batch]), but it returned a "
            "scalar: pass an unreduced loss, e.g. keras.losses.SparseCategoricalCrossentropy() "
            "(towers calls its .call) or a function of (y_true, y_pred) without a mean"
        )
    if not values.dtype.is_floating:
        raise ValueError(
            f"loss must return floating-point values to differentiate; it returned "
            f"{values.dtype.name} values of shape {values.shape.as_list()}")
    pred = tf.nest.flatten(y_pred)[0] if y_pred is not None else None
    pred_shape: Any = getattr(pred, "shape", None)
    batch = pred_shape[0] if pred_shape is not None and pred_shape.rank else None
    if values.shape.rank is not None and batch is not None and values.shape[0] is not None \
            and values.shape[0] != batch:  # fmt: skip
        raise ValueError(
            f"loss must return one value per example (first axis = the batch, {batch}), "
            f"but it returned shape {values.shape.as_list()} for predictions of shape "
            f"{pred_shape.as_list()}: a mean over the batch, or labels broadcast against "
            "the predictions? Return the unreduced values, as keras.losses.Loss.call does")
    return values


def extra_axes(reduction: str) -> str:
    """How :func:`per_example_loss` reduces a loss value's extra axes for ``reduction``."""
    return "sum" if reduction == "sum" else "mean"


def weighs_elements(sample_weight: Any) -> bool:
    """Whether ``sample_weight`` weighs a loss's elements rather than its examples
    (``[batch]`` or ``[batch, 1]``)."""
    shape = getattr(sample_weight, "shape", None)
    if shape is None:
        return False
    dims = list(shape)
    return len(dims) > 2 or (len(dims) == 2 and dims[1] != 1)
