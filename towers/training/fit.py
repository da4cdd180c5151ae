"""Keras-style ``fit``, ``evaluate`` and ``predict`` for a :class:`~towers.TowerTrainer`.

::

    fit:  for each epoch                                  (Keras callbacks around each box)
            batches: arrays (reshuffled per epoch) or a tf.data.Dataset
              │ on_train_batch_begin
              ▼
            trainer.train_step(x, y, w)  ─ split ─ towers ─ all-reduce ─ apply
              │ on_train_batch_end(logs: running loss and metrics)
              ▼
            validation_data ─▶ evaluate ─▶ val_* ─▶ on_epoch_end ─▶ History

    evaluate / predict: one compiled function per batch shape, no tape
            batch ─split─▶ shard_i ─tf.device(tower_i): model(shard_i, training=False)─▶ out_i
                  ─▶ concat(out_0 … out_{n-1}) on the parameter device, in tower order

How the numbers are aggregated, and why each is exact:

- **Loss.** Tower ``i`` sums its own weighted per-example losses ``S_i = Σ w·l``; the
  sums are added in tower order and divided once by the number of examples, which is
  how :meth:`~towers.Trainer.train_step` forms its global mean. Over an epoch,
  batch ``b`` contributes ``B_b · L_b`` to a float64 total that is divided once by
  ``Σ B_b`` — the example-weighted mean Keras' loss tracker reports, never a mean of
  tower means (which over-weights a short last shard). Regularization losses are added
  once, as in Keras.
- **Metrics** (any Keras metric). Each batch's outputs are concatenated in tower order
  and the metric's state is updated once with ``(y, outputs, sample_weight)``.
  Concatenation does no arithmetic, so the metric sees exactly what a single-device
  Keras loop would see for those outputs, whatever the number of towers. (Updating a
  copy per tower and adding the states would be exact for counting metrics such as
  accuracy — integer counts below 2**24 add exactly in float32 — but not for metrics
  whose state is a float sum, e.g. mean squared error: partial sums round differently.)
- **Training metrics** come from the step's own forward pass (training mode, the
  outputs of every tower concatenated in tower order: ``train_step(...,
  return_outputs=True)``), as in Keras. The loss is always the step's own.

Callbacks get ``model=trainer.model``; ``model.stop_training`` ends training after the
batch or epoch that set it. Because callbacks such as EarlyStopping(restore_best_weights)
write to ``trainer.model`` only, the other replicas copy its weights after every epoch.
Callbacks that change the optimizer (LearningRateScheduler, ReduceLROnPlateau) do not
apply: ``trainer.model`` has no optimizer, every replica has its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.machinery.ordering import as_written
from towers.guard.arguments import non_negative_int, optional
from towers.guard.inputs import naming
from towers.training.backup import Backup, data_facts
from towers.training.inference import inference
from towers.training.metrics import Metrics, MetricSpec
from towers.training.protocol import Trainer
from towers.training.sources import (
    Batch,
    Source,
    batch_length,
    inputs,
    source,
    validation_source,
)

__all__ = ["evaluate", "fit", "predict"]


# -- the loops ----------------------------------------------------------------------------------


def _callbacks(
    callbacks: Any, trainer: Trainer, verbose: Any, *, history: bool, **params: Any
) -> keras.callbacks.CallbackList:
    """Keras' callback container, with a History (fit) and a progress bar (verbose > 0)."""
    if isinstance(verbose, str) and verbose == "auto":
        verbose = 1
    if not isinstance(verbose, int | np.integer) or verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}")
    if callbacks is not None and (
        not isinstance(callbacks, Sequence)
        or not all(isinstance(c, keras.callbacks.Callback) for c in callbacks)
    ):
        raise TypeError(f"callbacks must be None or a list of keras.callbacks.Callback, got "
                        f"{callbacks!r}")  # fmt: skip
    return keras.callbacks.CallbackList(
        callbacks,
        add_history=history,
        add_progbar=verbose != 0,
        model=trainer.model,
        verbose=verbose,
        **params,
    )


def _skipped(trainer: Trainer) -> int | None:
    """The trainer's count of skipped non-finite steps, or None when it does not guard."""
    if getattr(trainer, "on_nonfinite", "ignore") == "ignore":
        return None
    return int(getattr(trainer, "skipped_steps", 0))


def _train_epoch(
    trainer: Trainer, batches: Iterator[Batch], specs: Any, callbacks: Any,
    skip: int = 0, done: Callable[[int], None] | None = None,
) -> dict[str, float]:  # fmt: skip
    """One pass of train steps; returns the epoch's logs (loss, training metrics, skips).

    A step the non-finite guard skipped changed nothing, so its (NaN) loss and outputs
    are left out of the loss and the metrics; ``skipped`` counts such steps. The first
    ``skip`` batches (trained before a resume) are drawn and passed over; ``done(step)``
    runs after each trained batch, before its callbacks (it saves checkpoints).
    """
    metrics = Metrics(specs)
    total, count = 0.0, 0
    first = last = _skipped(trainer)
    logs: dict[str, float] = {}
    for step, (x, y, sw) in enumerate(batches):
        if step < skip:
            continue
        callbacks.on_train_batch_begin(step)
        if metrics.specs:
            loss_t, y_pred = trainer.train_step(x, y, sw, return_outputs=True)
        else:
            loss_t, y_pred = trainer.train_step(x, y, sw), None
        now = _skipped(trainer)
        if now == last:  # applied (or not guarded)
            if y_pred is not None:
                metrics.update(y, y_pred, sw)
            size = batch_length(tf.nest.map_structure(tf.convert_to_tensor, x))
            total, count = total + float(loss_t) * size, count + size
        last = now
        if done is not None:
            done(step)
        logs = {"loss": total / count if count else float("nan"), **metrics.results()}
        if first is not None and now is not None:
            logs["skipped"] = float(now - first)
        callbacks.on_train_batch_end(step, logs)
        if getattr(trainer.model, "stop_training", False):
            break
    return logs


def _evaluate_source(
    trainer: Trainer, source: Source, specs: Any, callbacks: Any
) -> dict[str, float]:
    """Loss (Σ w·l / examples + regularization) and metrics over every batch of ``source``."""
    metrics = Metrics(specs)
    total, count = 0.0, 0
    callbacks.on_test_begin()
    for step, (x, y, sw) in enumerate(source.epoch()):
        callbacks.on_test_batch_begin(step)
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        sw = None if sw is None else tf.convert_to_tensor(sw)
        with as_written():
            batch_sum, y_pred = inference(trainer).loss_and_outputs(x, y, sw)
        metrics.update(y, y_pred, sw)
        total, count = total + float(batch_sum), count + batch_length(x)
        callbacks.on_test_batch_end(step, {"loss": total / count})
    if count == 0:
        raise ValueError("x is empty: the dataset yielded no batches")
    reg = sum(float(r) for r in trainer.model.losses)
    logs = {"loss": total / count + reg, **metrics.results()}
    callbacks.on_test_end(logs)
    return logs


def _sync_replicas(trainer: Trainer) -> None:
    """Give every replica ``trainer.model``'s weights (a callback may have set them)."""
    if len(trainer.replicas) > 1:
        trainer.set_weights(trainer.model.get_weights())


def fit(
    trainer: Trainer,
    x: Any,
    y: Any = None,
    *,
    batch_size: int = 32,
    epochs: int = 1,
    validation_data: Any = None,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose: int | str = 1,
    shuffle: bool = True,
    seed: int | None = None,
    metrics: Sequence[MetricSpec] | None = None,
    sample_weight: Any = None,
    checkpoint_dir: Any = None,
    checkpoint_every: int | None = None,
    checkpoint_keep: int = 3,
    resume: bool = True,
) -> keras.callbacks.History:
    """Train for ``epochs`` epochs with :meth:`~towers.Trainer.train_step`, like ``model.fit``.

    Args:
        trainer: the :class:`~towers.TowerTrainer`.
        x: inputs (an array or a nest of arrays), or a ``tf.data.Dataset`` of
            ``(x, y)`` or ``(x, y, sample_weight)`` batches.
        y: targets (arrays only).
        batch_size: global batch size for arrays (a dataset is used as batched).
        epochs: passes over the data (0 trains nothing).
        validation_data: ``(x, y)``, ``(x, y, sample_weight)`` or a dataset, evaluated
            after every epoch into ``val_*`` logs.
        callbacks: Keras callbacks; ``model`` is ``trainer.model``.
        verbose: 0 silent, 1 progress bar, 2 one line per epoch.
        shuffle: reshuffle array data every epoch.
        seed: seed of the shuffling (a NumPy ``default_rng``).
        metrics: Keras metrics (names such as ``"accuracy"``, classes' instances or
            functions), reported for training and validation data.
        sample_weight: per-example weights (arrays only).
        checkpoint_dir: save numbered checkpoints here, atomically, with the position
            in the data (:mod:`towers.training.backup`; docs/checkpoints.md).
        checkpoint_every: save after every k trained batches (None: every epoch's end).
        checkpoint_keep: how many of the newest checkpoints to keep.
        resume: with ``checkpoint_dir``, first restore its latest good checkpoint and
            go on from the batch after it (bitwise the run that was not interrupted); one
            of another trainer, batch size or data is a ``CheckpointError``, nothing changed.

    Returns:
        The ``keras.callbacks.History``: ``history.history["loss"]`` per epoch, and
        ``"skipped"``: the steps the trainer's non-finite guard skipped in each epoch
        (absent with ``on_nonfinite="ignore"``). The loss and training metrics average
        the applied steps only.

    Raises:
        ValueError: ``y`` missing for arrays, ``batch_size`` < 1, ``epochs`` < 0,
            lengths that differ, empty data, or malformed ``validation_data``.

    Example:
        >>> history = trainer.fit(x, y, batch_size=64, epochs=3,        # doctest: +SKIP
        ...                       validation_data=(x_val, y_val), metrics=["accuracy"])
    """
    epochs = non_negative_int("epochs", epochs)
    train = source(x, y, sample_weight, batch_size, need_y=True)
    val = None if validation_data is None else naming(
        "validation_data", lambda: validation_source(validation_data, batch_size))  # fmt: skip
    cbs = _callbacks(callbacks, trainer, verbose, history=True, epochs=epochs, steps=train.steps)
    for name, flag in (("shuffle", shuffle), ("resume", resume)):
        if not isinstance(flag, bool | np.bool_):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    optional(non_negative_int, "seed", seed)
    rng = np.random.default_rng(seed) if shuffle else None
    trainer.model.stop_training = False
    if not hasattr(trainer.model, "optimizer"):
        # TensorBoard reads model.optimizer; an uncompiled model has none (see module doc).
        trainer.model.optimizer = None
    backup = None if checkpoint_dir is None else Backup(trainer, checkpoint_dir,
        checkpoint_every, checkpoint_keep, data_facts(train, shuffle))  # fmt: skip
    start, skip = backup.resume(rng) if backup is not None and resume else (0, 0)
    cbs.on_train_begin()
    logs: dict[str, float] = {}
    for epoch in range(start, epochs):
        cbs.on_epoch_begin(epoch)
        if backup is not None:
            backup.epoch_begins(rng)
        done = None if backup is None else functools.partial(backup.batch_done, epoch)
        logs = _train_epoch(trainer, train.epoch(rng), metrics, cbs, skip, done)
        skip = 0
        if val is not None:
            val_logs = _evaluate_source(trainer, val, metrics, cbs)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        cbs.on_epoch_end(epoch, logs)
        _sync_replicas(trainer)
        if backup is not None:
            backup.epoch_done(epoch, rng)
        if trainer.model.stop_training:
            break
    cbs.on_train_end(logs)
    _sync_replicas(trainer)
    return next(cb for cb in cbs.callbacks if isinstance(cb, keras.callbacks.History))


def evaluate(
    trainer: Trainer,
    x: Any,
    y: Any = None,
    *,
    batch_size: int = 32,
    metrics: Sequence[MetricSpec] | None = None,
    verbose: int | str = 0,
    return_dict: bool = False,
) -> float | list[float] | dict[str, float]:
    """Loss and metrics over the data, every batch split over the towers (no training).

    Args:
        trainer: the :class:`~towers.TowerTrainer`.
        x: inputs, or a ``tf.data.Dataset`` of ``(x, y)`` / ``(x, y, sample_weight)`` batches.
        y: targets (arrays only).
        batch_size: global batch size for arrays.
        metrics: Keras metrics, as in :func:`fit`.
        verbose: 0 silent, 1 progress bar.
        return_dict: return ``{"loss": …, name: …}`` instead of a list.

    Returns:
        The loss (a float) when there are no metrics, else ``[loss, *metrics]``, or a dict.
        The loss is ``Σ w·l / examples`` plus the model's regularization losses.

    Raises:
        ValueError: as in :func:`fit`.

    Example:
        >>> loss, acc = trainer.evaluate(x_test, y_test, metrics=["accuracy"])  # doctest: +SKIP
    """
    src = source(x, y, None, batch_size, need_y=True)
    cbs = _callbacks(None, trainer, verbose, history=False, epochs=1, steps=src.steps)
    logs = _evaluate_source(trainer, src, metrics, cbs)
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(
    trainer: Trainer, x: Any, *, batch_size: int = 32, verbose: int | str = 0
) -> np.ndarray:
    """The model's outputs (``training=False``), every batch split over the towers.

    Args:
        trainer: the :class:`~towers.TowerTrainer`.
        x: inputs (an array or nest of arrays), or a ``tf.data.Dataset`` yielding ``x``
            or ``(x, y[, sample_weight])`` batches (only ``x`` is used).
        batch_size: global batch size for arrays.
        verbose: 0 silent, 1 progress bar.

    Returns:
        The outputs of every example, in input order (a nest of arrays for a model
        with several outputs).

    Raises:
        ValueError: ``x`` empty or malformed, ``batch_size`` < 1.

    Example:
        >>> logits = trainer.predict(x_test, batch_size=256)         # doctest: +SKIP
    """
    batches, steps = inputs(x, batch_size)
    cbs = _callbacks(None, trainer, verbose, history=False, epochs=1, steps=steps)
    cbs.on_predict_begin()
    outs = []
    for step, xb in enumerate(batches):
        cbs.on_predict_batch_begin(step)
        with as_written():
            out = inference(trainer).outputs(tf.nest.map_structure(tf.convert_to_tensor, xb))
        outs.append(tf.nest.map_structure(np.asarray, out))
        cbs.on_predict_batch_end(step, {"outputs": out})
    cbs.on_predict_end()
    if not outs:
        raise ValueError("x is empty: the dataset yielded no batches")
    result: np.ndarray = tf.nest.map_structure(lambda *a: np.concatenate(a, axis=0), *outs)
    return result
