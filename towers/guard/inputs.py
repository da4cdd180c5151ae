"""The trainer's arguments and a step's shards, checked before anything is traced
(a step's batch: :func:`towers.split.batch_tensors`).

Each check raises ``TypeError`` (the wrong kind of object) or ``ValueError`` (the right
kind, a wrong value) naming the argument and what was expected, so a mistake never
surfaces as a raw TensorFlow error from inside the traced step. docs/bad_inputs.md
lists every case the tests hold, with the error it gets.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from towers.split import Shards, check_batch_against_model, shard_sizes

__all__ = ["KERAS_STEPS", "check_keras_steps", "check_kinds", "check_shards"]

def _kind(obj: object) -> str | None:
    """What Keras object ``obj`` is, for arguments passed in the wrong place."""
    if isinstance(obj, keras.Model):
        return "a keras.Model"
    if isinstance(obj, keras.layers.Layer):
        return f"a keras Layer ({type(obj).__name__})"
    if isinstance(obj, keras.losses.Loss):
        return f"a Keras loss ({type(obj).__name__})"
    if isinstance(obj, keras.optimizers.Optimizer):
        return f"a Keras optimizer ({type(obj).__name__})"
    return None


def check_kinds(model: Any, optimizer: Any, loss: Any) -> None:
    """Catch a model, optimizer or loss given in another's place (or a bare Layer).

    Raises:
        TypeError: naming the argument, what it got and what it expects.
    """
    kind = _kind(model)
    if kind and not isinstance(model, keras.Model):
        hint = (
            " wrap it: keras.Sequential([keras.Input(shape), layer])"
            if isinstance(model, keras.layers.Layer)
            else " — are the arguments in the order (model, optimizer, loss)?"
        )
        raise TypeError(f"model must be a keras.Model or a factory; got {kind}:{hint}")
    kind = _kind(optimizer)
    if kind and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"optimizer must be a Keras optimizer or a factory; got {kind} — are the "
            "arguments in the order (model, optimizer, loss)?"
        )
    kind = _kind(loss)
    if kind and not isinstance(loss, keras.losses.Loss):
        raise TypeError(
            f"loss must be a Keras loss, a loss name or a callable; got {kind} — are the "
            "arguments in the order (model, optimizer, loss)?"
        )


KERAS_STEPS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")
"""The ``keras.Model`` methods Keras's ``fit``/``evaluate``/``predict`` call on a model and a
``towers.TowerModel`` replaces with its towers' own step."""


def check_keras_steps(model: keras.Model) -> None:
    """Refuse a model that overrides Keras's step methods: ``TowerModel`` runs the towers'
    step (each tower: ``loss(y, model(x))``, all-reduced, applied) and would silently
    skip the model's own.

    Raises:
        TypeError: naming the model's class, the overridden methods and what to do instead.
    """
    own = [name for name in KERAS_STEPS
           if getattr(type(model), name, None) is not getattr(keras.Model, name)]  # fmt: skip
    if own:
        raise TypeError(
            f"model: {type(model).__name__} overrides {', '.join(own)}; TowerModel runs the "
            "towers' own step (per tower: the compiled loss of model(x), all-reduced, "
            "applied) and would ignore it. Move extra terms into the model (call, add_loss) "
            "or the compiled loss (any callable loss(y_true, y_pred)); for a step of your "
            "own, call a TowerTrainer's phases (split, forward_backward, reduce, apply)"
        )


def check_shards(shards: Any, devices: Any, model: Any) -> Shards:
    """``shards`` checked for ``TowerTrainer.train_step_shards``; sample weights cast to
    the model's dtype.

    Raises:
        TypeError: ``shards`` is not a :class:`~towers.split.Shards`.
        ValueError: a part per tower other than ``len(devices)``, sizes that are not
            MirroredStrategy's split of ``global_batch``, or a part that does not fit the model.
    """
    if not isinstance(shards, Shards):
        raise TypeError("shards must be a towers.split.Shards (from towers.split.distribute "
                        f"or trainer.split), got {type(shards).__name__}")  # fmt: skip
    n = len(devices)
    if len(shards.parts) != n or any(len(p) != 3 for p in shards.parts):
        raise ValueError(f"shards must hold {n} parts (x, y, sample_weight), one per tower; "
                         f"got {len(shards.parts)}")  # fmt: skip
    # static where known: inside a caller's tf.function (Keras' train_step) they may not be
    total, sizes = tf.get_static_value(shards.global_batch), shards.sizes
    if total is not None and None not in sizes and (
            total < 1 or sizes != shard_sizes(int(total), n)):  # fmt: skip
        raise ValueError(f"shards: sizes {sizes} are not MirroredStrategy's split of a "
                         f"global batch of {total} over {n} towers "
                         f"({shard_sizes(max(int(total), 0), n)})")  # fmt: skip
    check_batch_against_model(*shards.parts[0], model)
    dtype = tf.as_dtype(model.trainable_variables[0].dtype)
    parts = []
    for x, y, w in shards.parts:
        if w is not None and w.dtype != dtype:
            with tf.device(w.device):
                w = tf.cast(w, dtype)
        parts.append((x, y, w))
    return Shards(tuple(parts), shards.global_batch)
