"""A Keras loss as ``compile`` prepares it, one value per example, for the towers' step::

    loss given   "hinge" | "ce" | keras.losses.Loss | fn(y_true, y_pred)   resolve_loss
    labels       brought to the output's rank, as Keras wraps a loss       same_rank
    reduction    what the loss's Keras reduction asks for                  loss_reduction
    per output   compile(loss=[...] | {...}, loss_weights=...)             OutputLosses

A loss per model output::

    y_pred = model(x)      [out_a, out_b]  (a list, a tuple or a dict)
    y_true                 [y_a,   y_b]    (by position, or a dict by output name)
    losses, weights        [L_a,   L_b], [w_a, w_b]  (or dicts by name; one loss: every output)

    per example i:   w_a · L_a(y_a, out_a)_i  +  w_b · L_b(y_b, out_b)_i

Every output's loss must ask for the same Keras reduction; a loss of None trains no term.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import keras
import tensorflow as tf

from towers.guard.arguments import naming
from towers.tower import LossFn, per_example_loss

__all__ = ["CROSSENTROPY", "REDUCTIONS", "LossFn", "OutputLosses", "bind_loss", "is_structured",
           "loss_reduction", "reduction_of", "resolve_loss", "same_rank", "step_loss"]


REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")
"""The Keras loss reductions a trainer honours, each over the *global* batch."""


def resolve_loss(loss: str | LossFn | keras.losses.Loss) -> LossFn:
    """A loss name, Keras loss or callable as ``(y_true, y_pred) -> per-example losses``
    (``TypeError``: neither a name nor a callable; ``ValueError``: an unknown name)."""
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
    """``fn`` with ``y_true`` brought to ``y_pred``'s rank first, as Keras's
    ``LossFunctionWrapper`` does (labels ``(B,)`` and outputs ``(B, 1)`` would broadcast)."""

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
    """The reduction a loss asks for (a Keras ``Loss``'s, ``"none"`` meaning the default); a
    ``ValueError`` naming ``loss`` for one not in :data:`REDUCTIONS`."""
    if isinstance(loss, str):
        loss = None if loss.lower() in CROSSENTROPY else keras.losses.get(loss)
    reduction = loss.reduction if isinstance(loss, keras.losses.Loss) else None
    if reduction is None or reduction == "none":
        return REDUCTIONS[0]
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss: {type(loss).__name__} has reduction={reduction!r}, which towers "
                         f"does not support; use one of {', '.join(REDUCTIONS)}")
    return str(reduction)


def is_structured(loss: Any) -> bool:
    """``loss`` is a list, tuple or dict of losses (one per output)."""
    return isinstance(loss, list | tuple | Mapping)


def reduction_of(loss: Any) -> str:
    """The Keras reduction ``loss`` asks for (for a loss per output, the one they share)."""
    return (loss if isinstance(loss, OutputLosses) else OutputLosses(loss)).reduction


class OutputLosses:
    """``(y_true, y_pred) -> per-example losses`` summed over a multi-output model's outputs.

    Args:
        losses: one loss (every output), a list (model output order) or a dict by output
            name (an output left out or None trains no term).
        weights: None (all 1), a list (per output) or a dict by output name.
    """

    def __init__(self, losses: Any, weights: Any = None) -> None:
        self.losses, self.weights = losses, weights
        self.names: list[str] | None = None
        self._fns: list[tuple[Any, float]] = []
        given = losses.values() if isinstance(losses, Mapping) else (
            losses if isinstance(losses, list | tuple) else [losses])  # fmt: skip
        reductions = {loss_reduction(loss) for loss in given if loss is not None}
        if len(reductions) > 1:
            raise ValueError(f"loss: every output's loss must ask for the same reduction, "
                             f"got {sorted(reductions)}")  # fmt: skip
        self.reduction = reductions.pop() if reductions else "sum_over_batch_size"

    def bind(self, model: keras.Model) -> OutputLosses:
        """Match the losses and weights to ``model``'s outputs (by position or name)."""
        self.names = names = _output_names(model)
        losses = self._aligned("loss", self.losses, names, broadcast=True)
        weights = self._aligned("loss_weights", self.weights, names, broadcast=False)
        self._fns = [(None, 0.0) if loss is None else
                     (resolve_loss(loss), 1.0 if weight is None else float(weight))
                     for loss, weight in zip(losses, weights)]
        if all(fn is None for fn, _ in self._fns):
            raise ValueError(f"loss: no output of the model ({', '.join(names)}) has a loss")
        return self

    @staticmethod
    def _aligned(what: str, given: Any, names: list[str], *, broadcast: bool) -> list[Any]:
        if given is None:
            return [None] * len(names)
        if isinstance(given, Mapping):
            unknown = sorted(set(given) - set(names))
            if unknown:
                raise ValueError(f"{what}: {unknown} are not outputs of the model; its outputs "
                                 f"are {names}")  # fmt: skip
            return [given.get(name) for name in names]
        if isinstance(given, list | tuple):
            if len(given) != len(names):
                raise ValueError(f"{what}: {len(given)} entries for a model with "
                                 f"{len(names)} outputs ({', '.join(names)})")  # fmt: skip
            return list(given)
        if broadcast:
            return [given] * len(names)
        raise TypeError(f"{what} must be a list or a dict by output name, got {given!r}")

    def _by_output(self, what: str, values: Any) -> list[Any]:
        assert self.names is not None, "OutputLosses.bind(model) first"
        if isinstance(values, Mapping):
            missing = [n for n in self.names if n not in values]
            if missing:
                raise ValueError(f"{what}: no entry for output(s) {missing}")
            return [values[name] for name in self.names]
        flat = list(values) if isinstance(values, list | tuple) else [values]
        if len(flat) != len(self.names):
            raise ValueError(f"{what}: {len(flat)} parts for a model with {len(self.names)} "
                             f"outputs ({', '.join(self.names)})")  # fmt: skip
        return flat

    def __call__(self, y_true: Any, y_pred: Any) -> tf.Tensor:
        trues, preds = self._by_output("y", y_true), self._by_output("y_pred", y_pred)
        total = None
        for (fn, weight), t, p in zip(self._fns, trues, preds):
            if fn is None:
                continue
            values = per_example_loss(fn, t, p, reduction=self.reduction)
            term = values if weight == 1.0 else values * tf.cast(weight, values.dtype)
            total = term if total is None else total + term
        assert total is not None
        return total


def _output_names(model: keras.Model) -> list[str]:
    """The model's output names, else ``output_0``, ``output_1``… (one when it cannot tell)."""
    names = getattr(model, "output_names", None)
    if names:
        return list(names)
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        outputs = None
    return [f"output_{i}" for i in range(len(outputs))] if outputs else ["output_0"]


def step_loss(loss: Any) -> Any:
    """The step's loss before the model exists: one per output, or one resolved callable."""
    if isinstance(loss, OutputLosses):
        return loss
    return OutputLosses(loss) if is_structured(loss) else resolve_loss(loss)


def bind_loss(resolved: Any, loss: Any, model: keras.Model) -> Any:
    """``resolved`` bound to ``model``'s outputs (one ``loss`` for each, when a model with
    several outputs was given one); a ``ValueError`` naming ``loss`` when they do not match."""
    if isinstance(resolved, OutputLosses) or len(getattr(model, "output_names", None) or []) > 1:
        per_output = resolved if isinstance(resolved, OutputLosses) else OutputLosses(loss)
        return naming("loss", lambda: per_output.bind(model))
    return resolved
