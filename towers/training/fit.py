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
  how :meth:`~towers.TowerTrainer.train_step` forms its global mean. Over an epoch,
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

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import keras
import numpy as np
import tensorflow as tf

from towers.allreduce.ordering import as_written
from towers.allreduce.primitives import send
from towers.split import shard_sizes, split
from towers.tower import per_example_loss

if TYPE_CHECKING:
    from towers.step import TowerTrainer

__all__ = ["evaluate", "fit", "predict"]

Batch: TypeAlias = tuple[Any, Any, Any]
MetricSpec: TypeAlias = "str | keras.metrics.Metric | Callable[..., Any]"


# -- data ---------------------------------------------------------------------------------------


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _length(name: str, value: Any) -> int:
    """The common leading dimension of every array in ``value``."""
    sizes = set()
    for leaf in tf.nest.flatten(value):
        if np.ndim(leaf) == 0:
            raise ValueError(f"{name}: every array needs a batch dimension, got a scalar")
        sizes.add(int(np.shape(leaf)[0]))
    if len(sizes) != 1:
        raise ValueError(f"{name}: its arrays have different lengths {sorted(sizes)}")
    return sizes.pop()


@dataclasses.dataclass(frozen=True)
class _Source:
    """One epoch's worth of batches: from arrays (sliced per epoch) or from a dataset."""

    arrays: Batch | None
    dataset: tf.data.Dataset | None
    batch_size: int
    steps: int | None

    def epoch(self, rng: np.random.Generator | None = None) -> Iterator[Batch]:
        """The batches of one epoch; ``rng`` shuffles array data (datasets shuffle themselves)."""
        if self.dataset is not None:
            for element in self.dataset:
                yield _unpack(element)
            return
        assert self.arrays is not None
        x, y, sample_weight = self.arrays
        count = _length("x", x)
        order = rng.permutation(count) if rng is not None else np.arange(count)
        for start in range(0, count, self.batch_size):
            rows = order[start : start + self.batch_size]
            yield _take(x, rows), _take(y, rows), _take(sample_weight, rows)


def _take(arrays: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of every array in a nest (None stays None)."""
    return None if arrays is None else tf.nest.map_structure(lambda a: a[rows], arrays)


def _unpack(element: Any) -> Batch:
    if isinstance(element, tuple) and len(element) in (2, 3):
        x, y, *rest = element
        return x, y, rest[0] if rest else None
    raise ValueError(
        "x: a tf.data.Dataset for fit/evaluate must yield (x, y) or (x, y, sample_weight) "
        f"batches, got {type(element).__name__}"
    )


def _source(x: Any, y: Any, sample_weight: Any, batch_size: int, *, need_y: bool) -> _Source:
    """Validate inputs and describe their batches.

    Raises:
        ValueError: naming the argument at fault (see :func:`fit`).
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    if isinstance(x, tf.data.Dataset):
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValueError(f"{name} must be None when x is a tf.data.Dataset")
        steps = int(x.cardinality())
        return _Source(None, x, batch_size, steps if steps >= 0 else None)
    if x is None:
        raise ValueError("x is required: arrays or a tf.data.Dataset")
    if need_y and y is None:
        raise ValueError("y is required when x is an array (or pass a tf.data.Dataset)")
    count = _length("x", x)
    if count == 0:
        raise ValueError("x is empty: it has 0 examples")
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None and _length(name, value) != count:
            raise ValueError(f"{name} has {_length(name, value)} examples but x has {count}")
    x, y, sample_weight = (
        None if a is None else tf.nest.map_structure(np.asarray, a) for a in (x, y, sample_weight)
    )
    return _Source((x, y, sample_weight), None, batch_size, -(-count // batch_size))


def _validation_source(validation_data: Any, batch_size: int) -> _Source:
    if isinstance(validation_data, tf.data.Dataset):
        return _source(validation_data, None, None, batch_size, need_y=True)
    if isinstance(validation_data, tuple | list) and len(validation_data) in (2, 3):
        x, y, sample_weight = (*validation_data, None)[:3]
        return _source(x, y, sample_weight, batch_size, need_y=True)
    raise ValueError(
        "validation_data must be (x, y), (x, y, sample_weight) or a tf.data.Dataset, "
        f"got {type(validation_data).__name__}"
    )


def _batch_length(x: Any) -> int:
    return int(tf.nest.flatten(x)[0].shape[0])


# -- the towers' inference pass -------------------------------------------------------------------


class _Towers:
    """A trainer's compiled inference passes (traced once per batch shape).

    Holds the trainer weakly so that the cache below does not keep it alive.
    """

    def __init__(self, trainer: TowerTrainer) -> None:
        self._trainer = weakref.ref(trainer)
        self.outputs = tf.function(self._outputs, autograph=False)
        self.loss_and_outputs = tf.function(self._loss_and_outputs, autograph=False)

    def _run(self, batch: Batch) -> list[tuple[str, tuple[Any, ...], Any]]:
        """``(device, shard, outputs)`` of every tower that has examples, in tower order."""
        trainer = self._trainer()
        assert trainer is not None
        n = len(trainer.devices)
        sizes = shard_sizes(_batch_length(batch[0]), n)
        present = tuple(part for part in batch if part is not None)
        done = []
        for i, (device, shard) in enumerate(zip(trainer.devices, split(present, n))):
            if sizes[i] == 0:  # Conv2D (and others) fail on 0 rows: an empty tower sits out
                continue
            replica = trainer.replicas[i if len(trainer.replicas) > 1 else 0]
            with tf.device(device):
                done.append((device, shard, replica.model(shard[0], training=False)))
        return done

    def _gather(self, outs: Sequence[Any]) -> Any:
        """Concatenate the towers' outputs on the parameter device, in tower order."""
        trainer = self._trainer()
        assert trainer is not None
        home = trainer.parameter_device
        with tf.device(home):
            moved = [
                tf.nest.map_structure(lambda t: send(t, home, note="outputs"), out) for out in outs
            ]
            return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *moved)

    def _outputs(self, x: Any) -> Any:
        return self._gather([out for _, _, out in self._run((x, None, None))])

    def _loss_and_outputs(self, x: Any, y: Any, sample_weight: Any) -> tuple[tf.Tensor, Any]:
        """``(Σ w·l over the batch, outputs)``: each tower sums its own losses."""
        trainer = self._trainer()
        assert trainer is not None
        done = self._run((x, y, sample_weight))
        sums = []
        for device, shard, out in done:
            with tf.device(device):
                per_ex = per_example_loss(trainer.loss_fn, shard[1], out)
                if sample_weight is not None:
                    per_ex = per_ex * tf.cast(shard[2], per_ex.dtype)
                sums.append(tf.reduce_sum(per_ex))
        home = trainer.parameter_device
        with tf.device(home):
            total = tf.add_n([send(s, home, note="loss") for s in sums])
        return total, self._gather([out for _, _, out in done])


_CACHE: weakref.WeakKeyDictionary[Any, _Towers] = weakref.WeakKeyDictionary()


def _towers(trainer: TowerTrainer) -> _Towers:
    if trainer not in _CACHE:
        _CACHE[trainer] = _Towers(trainer)
    return _CACHE[trainer]


# -- metrics ------------------------------------------------------------------------------------


def _accuracy(name: str, y_true: Any, y_pred: Any) -> keras.metrics.Metric:
    """Keras' rule for ``"accuracy"``: binary, sparse categorical or categorical."""
    if y_pred.shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name=name)
    sparse = y_true.shape.rank < y_pred.shape.rank or y_true.shape[-1] == 1
    if sparse:
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    return keras.metrics.CategoricalAccuracy(name=name)


def _metric(spec: MetricSpec, y_true: Any, y_pred: Any) -> keras.metrics.Metric:
    """A fresh metric for ``spec`` (a caller's Metric object is copied, not updated)."""
    if isinstance(spec, keras.metrics.Metric):
        return type(spec).from_config(spec.get_config())
    if isinstance(spec, str) and spec.lower() in ("accuracy", "acc"):
        return _accuracy(spec, tf.convert_to_tensor(y_true), tf.convert_to_tensor(y_pred))
    try:
        got = keras.metrics.get(spec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"metrics: unknown metric {spec!r}") from err
    if isinstance(got, keras.metrics.Metric):
        return got
    name = spec if isinstance(spec, str) else getattr(spec, "__name__", "metric")
    return keras.metrics.MeanMetricWrapper(got, name=name)


class _Metrics:
    """The metrics of one pass over data, built on the first batch (``"accuracy"`` needs
    the shapes), each updated once per batch on the concatenated outputs."""

    def __init__(self, specs: Sequence[MetricSpec] | None) -> None:
        if specs is not None and (isinstance(specs, str) or not isinstance(specs, Sequence)):
            raise ValueError(f"metrics must be a list, got {specs!r}")
        self.specs = list(specs or [])
        self.metrics: list[keras.metrics.Metric] = []
        for spec in self.specs:  # fail before training, not after the first batch
            if isinstance(spec, str) and spec.lower() not in ("accuracy", "acc"):
                _metric(spec, None, None)

    def update(self, y: Any, y_pred: Any, sample_weight: Any) -> None:
        if self.specs and not self.metrics:
            self.metrics = [_metric(s, y, y_pred) for s in self.specs]
        for m in self.metrics:
            m.update_state(y, y_pred, sample_weight=sample_weight)

    def results(self) -> dict[str, float]:
        return {m.name: float(m.result()) for m in self.metrics}


# -- the loops ----------------------------------------------------------------------------------


def _callbacks(
    callbacks: Any, trainer: TowerTrainer, verbose: Any, *, history: bool, **params: Any
) -> keras.callbacks.CallbackList:
    """Keras' callback container, with a History (fit) and a progress bar (verbose > 0)."""
    if verbose == "auto":
        verbose = 1
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}")
    return keras.callbacks.CallbackList(
        callbacks,
        add_history=history,
        add_progbar=verbose != 0,
        model=trainer.model,
        verbose=verbose,
        **params,
    )


def _train_epoch(
    trainer: TowerTrainer, batches: Iterator[Batch], specs: Any, callbacks: Any
) -> dict[str, float]:
    """One pass of train steps; returns the epoch's logs (loss and training metrics)."""
    metrics = _Metrics(specs)
    total, count = 0.0, 0
    logs: dict[str, float] = {}
    for step, (x, y, sw) in enumerate(batches):
        callbacks.on_train_batch_begin(step)
        if metrics.specs:
            loss_t, y_pred = trainer.train_step(x, y, sw, return_outputs=True)
            metrics.update(y, y_pred, sw)
            loss = float(loss_t)
        else:
            loss = float(trainer.train_step(x, y, sw))
        size = _batch_length(tf.nest.map_structure(tf.convert_to_tensor, x))
        total, count = total + loss * size, count + size
        logs = {"loss": total / count, **metrics.results()}
        callbacks.on_train_batch_end(step, logs)
        if getattr(trainer.model, "stop_training", False):
            break
    return logs


def _evaluate_source(
    trainer: TowerTrainer, source: _Source, specs: Any, callbacks: Any
) -> dict[str, float]:
    """Loss (Σ w·l / examples + regularization) and metrics over every batch of ``source``."""
    metrics = _Metrics(specs)
    total, count = 0.0, 0
    callbacks.on_test_begin()
    for step, (x, y, sw) in enumerate(source.epoch()):
        callbacks.on_test_batch_begin(step)
        x, y = tf.nest.map_structure(tf.convert_to_tensor, (x, y))
        sw = None if sw is None else tf.convert_to_tensor(sw)
        with as_written():
            batch_sum, y_pred = _towers(trainer).loss_and_outputs(x, y, sw)
        metrics.update(y, y_pred, sw)
        total, count = total + float(batch_sum), count + _batch_length(x)
        callbacks.on_test_batch_end(step, {"loss": total / count})
    if count == 0:
        raise ValueError("x is empty: the dataset yielded no batches")
    reg = sum(float(r) for r in trainer.model.losses)
    logs = {"loss": total / count + reg, **metrics.results()}
    callbacks.on_test_end(logs)
    return logs


def _sync_replicas(trainer: TowerTrainer) -> None:
    """Give every replica ``trainer.model``'s weights (a callback may have set them)."""
    if len(trainer.replicas) > 1:
        trainer.set_weights(trainer.model.get_weights())


def fit(
    trainer: TowerTrainer,
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
) -> keras.callbacks.History:
    """Train for ``epochs`` epochs with :meth:`~towers.TowerTrainer.train_step`, like ``model.fit``.

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

    Returns:
        The ``keras.callbacks.History``: ``history.history["loss"]`` per epoch.

    Raises:
        ValueError: ``y`` missing for arrays, ``batch_size`` < 1, ``epochs`` < 0,
            lengths that differ, empty data, or malformed ``validation_data``.

    Example:
        >>> history = trainer.fit(x, y, batch_size=64, epochs=3,        # doctest: +SKIP
        ...                       validation_data=(x_val, y_val), metrics=["accuracy"])
    """
    epochs = _check_int("epochs", epochs, 0)
    train = _source(x, y, sample_weight, batch_size, need_y=True)
    val = None if validation_data is None else _validation_source(validation_data, batch_size)
    cbs = _callbacks(callbacks, trainer, verbose, history=True, epochs=epochs, steps=train.steps)
    rng = np.random.default_rng(seed) if shuffle else None
    trainer.model.stop_training = False
    if not hasattr(trainer.model, "optimizer"):
        # TensorBoard reads model.optimizer; an uncompiled model has none (see module doc).
        trainer.model.optimizer = None
    cbs.on_train_begin()
    logs: dict[str, float] = {}
    for epoch in range(epochs):
        cbs.on_epoch_begin(epoch)
        logs = _train_epoch(trainer, train.epoch(rng), metrics, cbs)
        if val is not None:
            val_logs = _evaluate_source(trainer, val, metrics, cbs)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        cbs.on_epoch_end(epoch, logs)
        _sync_replicas(trainer)
        if trainer.model.stop_training:
            break
    cbs.on_train_end(logs)
    _sync_replicas(trainer)
    return next(cb for cb in cbs.callbacks if isinstance(cb, keras.callbacks.History))


def evaluate(
    trainer: TowerTrainer,
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
    source = _source(x, y, None, batch_size, need_y=True)
    cbs = _callbacks(None, trainer, verbose, history=False, epochs=1, steps=source.steps)
    logs = _evaluate_source(trainer, source, metrics, cbs)
    if return_dict:
        return logs
    values = list(logs.values())
    return values[0] if len(values) == 1 else values


def predict(
    trainer: TowerTrainer, x: Any, *, batch_size: int = 32, verbose: int | str = 0
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
    batches, steps = _inputs(x, batch_size)
    cbs = _callbacks(None, trainer, verbose, history=False, epochs=1, steps=steps)
    cbs.on_predict_begin()
    outs = []
    for step, xb in enumerate(batches):
        cbs.on_predict_batch_begin(step)
        with as_written():
            out = _towers(trainer).outputs(tf.nest.map_structure(tf.convert_to_tensor, xb))
        outs.append(tf.nest.map_structure(np.asarray, out))
        cbs.on_predict_batch_end(step, {"outputs": out})
    cbs.on_predict_end()
    if not outs:
        raise ValueError("x is empty: the dataset yielded no batches")
    result: np.ndarray = tf.nest.map_structure(lambda *a: np.concatenate(a, axis=0), *outs)
    return result


def _inputs(x: Any, batch_size: int) -> tuple[Iterator[Any], int | None]:
    """The input batches ``predict`` reads; a dataset's ``(x, y[, w])`` elements give ``x``."""
    if not isinstance(x, tf.data.Dataset):
        source = _source(x, None, None, batch_size, need_y=False)
        return (xb for xb, _, _ in source.epoch()), source.steps
    _check_int("batch_size", batch_size, 1)
    steps = int(x.cardinality())
    elements = (e[0] if isinstance(e, tuple) and len(e) in (1, 2, 3) else e for e in x)
    return elements, steps if steps >= 0 else None
