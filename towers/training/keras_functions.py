"""The per-batch functions ``towers.TowerModel`` hands Keras's loop.

::

    Keras fit/evaluate/predict ──▶ function(iterator)     steps_per_execution batches per call
        train:   batch ─▶ trainer.train_step_as_keras(x, y, w, batch_unknown)  (resume: skipped)
        test:    batch ─▶ inference(trainer).loss_and_outputs ─▶ loss / divisor (+ model losses)
        predict: batches ─▶ inference(trainer).outputs ─▶ concatenated

Each takes the ``TowerModel`` (typed ``Any``: this package sits below :mod:`towers.model`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from towers.split import batch_size, shard_sizes
from towers.training.inference import inference
from towers.training.keras_loss import loss_divisor

__all__ = ["batch_unknown", "predict_function", "relaxes", "test_function", "train_function"]


def train_function(tm: Any) -> Callable[[Any], Any]:
    """Keras's ``train_function``: a towers step per batch (:func:`train_batch`)."""
    return _loop(tm, train_batch)


def test_function(tm: Any) -> Callable[[Any], Any]:
    """Keras's ``test_function``: the towers' inference pass per batch (:func:`test_batch`)."""
    return _loop(tm, test_batch)


def predict_function(tm: Any) -> Callable[[Sequence[Any]], Any]:
    """Keras's ``predict_function``: the towers' outputs on each batch, concatenated."""

    def function(data: Sequence[Any]) -> Any:
        trainer = tm._trainer()
        outs = []
        for batch in data:
            x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
            outs.append(inference(trainer).outputs(x))
        if len(outs) == 1:
            return outs[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outs)

    return function


def _loop(tm: Any, one_batch: Callable[..., dict[str, Any]]) -> Callable[[Any], Any]:
    """``steps_per_execution`` calls of ``one_batch``, told whether the batch size is unknown."""

    def function(iterator: Any) -> Any:
        unknown = batch_unknown(getattr(iterator, "element_spec", None))
        logs = None
        for _, data in zip(range(tm.steps_per_execution), iterator):
            logs = one_batch(tm, data, batch_unknown=unknown) or logs or {}
        if logs is None:  # the data ran out: Keras's catch_stop_iteration ends the epoch
            raise StopIteration
        return logs

    return function


def train_batch(tm: Any, data: Any, *, batch_unknown: bool = False) -> dict[str, Any]:
    """One towers step on ``data``; the metrics' logs (empty for a batch a resume skips)."""
    if tm.resume_skip > 0:
        tm.resume_skip -= 1
        return {}
    trainer = tm._trainer()
    if tm.broadcast_pending:  # an epoch's first step: on_epoch_begin's writes reach every replica
        tm.broadcast_pending = False
        tm.broadcast()
    tm._hyper.follow(trainer)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    loss, outputs = trainer.train_step_as_keras(x, y, sample_weight, batch_unknown=batch_unknown)
    return update_metrics(tm, x, y, outputs, sample_weight, loss)


def test_batch(tm: Any, data: Any, *, batch_unknown: bool = False) -> dict[str, Any]:
    """The towers' inference pass on ``data``: the global mean loss and the metrics' logs."""
    trainer = tm._trainer()
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    passes = inference(trainer)
    relaxed = relaxes(batch_unknown, x, len(trainer.devices))
    total, outputs, model_loss = (passes.relaxed_loss_and_outputs if relaxed
                                  else passes.loss_and_outputs)(x, y, sample_weight)  # fmt: skip
    size = tf.shape(tf.nest.flatten(x)[0])[0]
    weights = [] if sample_weight is None else [sample_weight]
    divisor = loss_divisor(trainer.loss_reduction, size, weights, trainer.parameter_device)
    # the model's losses come out of the traced pass: model.losses read here, outside it,
    # would hold that graph's tensors (add_loss, activity regularizers)
    loss = total / tf.cast(divisor, total.dtype) + model_loss
    return update_metrics(tm, x, y, outputs, sample_weight, loss)


def update_metrics(tm: Any, x: Any, y: Any, outputs: Any, sample_weight: Any,
                   loss: Any) -> dict[str, Any]:  # fmt: skip
    """Feed the loss tracker the batch's mean loss (weight: its size, as MirroredStrategy's
    trackers sum to) and the compiled metrics the outputs; Keras's ``compute_metrics`` logs."""
    size = tf.shape(tf.nest.flatten(x)[0])[0]
    tm._loss_tracker.update_state(loss, sample_weight=size)
    if getattr(tm, "output_names", None):  # a model with several outputs: "a_loss", "b_loss"
        tm._compile_loss(y, outputs, sample_weight)  # updates Keras's per-output trackers
    return tm.compute_metrics(x, y, outputs, sample_weight=sample_weight)  # type: ignore[no-any-return]


def batch_unknown(element_spec: Any) -> bool:
    """Whether some tensor of ``element_spec`` has an unknown leading dimension."""
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and (shape.rank is None or (shape.rank > 0 and shape[0] is None)):
            return True
    return False


def relaxes(batch_unknown: bool, x: Any, towers: int) -> bool:
    """Whether a step on ``x`` takes the relaxed trace: the batch size is unknown to Keras
    and no tower is empty (empty towers need the static trace, which skips them)."""
    if not batch_unknown:
        return False
    size = tf.get_static_value(batch_size(x))
    return size is not None and 0 not in shard_sizes(int(size), towers)
