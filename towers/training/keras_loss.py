"""A Keras loss as ``compile`` prepares it, one value per example, for the towers' step::

    loss given   "hinge" | "ce" | keras.losses.Loss | fn(y_true, y_pred)   resolve_loss
    labels       brought to the output's rank, as Keras wraps a loss       same_rank
    reduction    what the loss's Keras reduction asks for                  loss_reduction

The values per example and the divisor are the tower's (:mod:`towers.tower`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["CROSSENTROPY", "REDUCTIONS", "LossFn", "loss_reduction", "resolve_loss", "same_rank"]

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
