"""A Keras loss as ``compile`` prepares it, one value per example, for the towers' step.

What Keras's ``compile`` and ``Loss.__call__`` do between a model's output and the
scalar it trains on, cut where the towers need it: per example, before the global
divisor (towers/tower.py divides every tower's weighted sum by it)::

    loss given   "hinge" | "ce" | keras.losses.Loss | fn(y_true, y_pred)   resolve_loss
    labels       brought to the output's rank, as Keras wraps a loss       same_rank
    values       l[b, t…] ── · w[b, t…] (a per-element sample weight) ──▶ mean over t…
                 (sum over t… for the reduction "sum")                     per_example_loss
    divisor      B, 1 ("sum") or Σw ("mean_with_sample_weight")            loss_divisor

:data:`REDUCTIONS` lists the reductions a trainer honours over the *global* batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.allreduce.machinery.primitives import send

__all__ = [
    "CROSSENTROPY",
    "REDUCTIONS",
    "LossFn",
    "extra_axes",
    "loss_divisor",
    "loss_reduction",
    "per_example_loss",
    "resolve_loss",
    "same_rank",
    "tower_divisor",
    "weighs_elements",
]

LossFn = Callable[[Any, Any], Any]

REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")
"""The Keras loss reductions a trainer honours, each over the *global* batch (what one
device computes on the whole batch; ``keras.losses.Loss(reduction=...)``):
``sum_over_batch_size`` (the default) and ``mean`` (the same in Keras): ``Σ w·l / B``;
``sum``: ``Σ w·l``; ``mean_with_sample_weight``: ``Σ w·l / Σ w`` with sample weights,
``Σ w·l / B`` without. ``"none"`` (or None), the loss of a custom training loop that
hands its per-example values to ``tf.nn.compute_average_loss``, trains exactly so:
``Σ w·l / B`` over the global batch, the same as the default."""


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
            resolved = keras.losses.get(loss)
        except ValueError as err:
            raise ValueError(f"loss: unknown Keras loss name {loss!r}") from err
        loss = resolved
    if isinstance(loss, keras.losses.Loss):
        # Loss.call gives the unreduced values; __call__ would average them.
        return loss.call
    if not callable(loss):
        raise TypeError(f"loss must be a Keras loss, a loss name or a callable; got {loss!r}")
    return same_rank(loss)


CROSSENTROPY = ("crossentropy", "ce")
"""Keras ``compile``'s loss aliases whose loss depends on the shapes (:func:`_crossentropy`)."""


def _crossentropy(y_true: Any, y_pred: Any) -> Any:
    """``loss="crossentropy"`` (or ``"ce"``): binary cross-entropy for one output unit,
    sparse categorical for labels of a lower rank or one column, else categorical — the
    rule of Keras's ``compile`` (``is_binary_or_sparse_categorical``)."""
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
    ``compile`` wraps a loss function (``LossFunctionWrapper``): labels of shape ``(B,)``
    against a ``(B, 1)`` output would otherwise broadcast to ``(B, B)`` (a wrong loss for
    ``hinge``, ``poisson``, ``kl_divergence``; an error for ``binary_crossentropy``)."""

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
    """The reduction a loss asks for (a Keras ``Loss``'s ``reduction``; the default else).

    ``"none"``/None is the default: per-example values, averaged over the global batch
    as ``tf.nn.compute_average_loss`` averages them.

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
    """What every tower divides its weighted loss sum by, for ``reduction`` (global batch).

    The global batch size (an int32, as ``tf.nn.compute_average_loss`` takes it) for
    ``sum_over_batch_size`` and ``mean`` — and for ``mean_with_sample_weight`` without
    sample weights, as Keras does; 1 for ``sum``; for ``mean_with_sample_weight`` with
    sample weights their sum over the whole batch (float32, formed on ``device`` from
    every tower's shard, in tower order).
    """
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
    """What one tower divides its loss sum by.

    Args:
        rule: the options' divisor rule (:attr:`~towers.guard.options.TowerOptions.divisor`).
        divisor: the step's global divisor (``TowerTrainer.loss_divisor``).
        shard: the tower's ``(x, y, sample_weight)``.
        towers: the number of towers (``num_replicas_in_sync``).

    Returns:
        ``divisor`` (``"global"``); ``shard size × towers`` (int32, ``"per_replica"``); the
        constant (int32 when it is a whole number, as ``compute_average_loss`` takes it).
    """
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
    """Per-example losses, shape ``[batch]``: a loss value's extra axes (per timestep, per
    pixel) are averaged (``extra_axes="mean"``) or added (``"sum"``, for Keras's reduction
    ``"sum"``, which adds every value; :func:`extra_axes`), so that dividing their total by
    the batch divides it by every value as Keras's other reductions do.

    A ``sample_weight`` that weighs elements, not examples (per timestep: ``[batch, T]``
    for loss values of shape ``[batch, T]``, :func:`weighs_elements`), is applied here, to
    the values before their extra axes are averaged, as Keras applies it; the caller then
    weighs nothing more. A per-example weight is the caller's.

    Raises:
        ValueError: the loss's values break the contract (:func:`_checked_values`); an
            element weight's shape is not the loss values' (a multi-output loss has one
            value per example).
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
    """A loss's output, checked where it is first traced: real floating values with the
    batch as their first axis, one row per example of ``y_pred`` (its first axis; a loss
    of a structured output is checked against its first leaf). A loss that averaged over
    the batch, or broadcast labels against outputs into ``[batch, batch]``-like shapes of
    the wrong length, would otherwise train on a wrong loss without a word.

    Raises:
        ValueError: a scalar, a non-floating or complex dtype, or a first axis that is
            not the batch, naming ``loss`` and both shapes.
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
    """Whether ``sample_weight`` weighs a loss's elements (it has axes beyond the batch and
    a trailing 1) rather than its examples (``[batch]`` or ``[batch, 1]``)."""
    shape = getattr(sample_weight, "shape", None)
    if shape is None:
        return False
    dims = list(shape)
    return len(dims) > 2 or (len(dims) == 2 and dims[1] != 1)
