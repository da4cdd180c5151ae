"""The custom training loop shared by the ``tf.distribute`` references.

This is the loop of TensorFlow's custom-training tutorial, made exact::

    batch ──experimental_distribute_dataset──▶ PerReplica(x, y, sw)     (TF's own split)
       │  strategy.run(replica_step)
       ▼
    per replica: GradientTape
       loss_r = compute_average_loss(per_ex, sw_r, global_batch_size=B)
              + scale_regularization_loss(add_n(model.losses))
       optimizer.apply_gradients(...)       (Keras 3 all-reduces through the strategy)
       │
       ▼
    strategy.reduce(SUM, loss_r)  ─▶ the step's global mean loss

Subclasses choose the strategy (:mod:`reference.mirrored`,
:mod:`reference.central_storage`); everything else lives here so that both
references compute the same loss in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import keras
import numpy as np
import tensorflow as tf

from towers.devices import canonical_device

__all__ = [
    "LossLike",
    "ModelLike",
    "OptimizerLike",
    "ReferenceUnavailable",
    "StrategyTrainer",
    "check_devices",
    "per_example_loss",
    "resolve_loss",
]

LossLike: TypeAlias = keras.losses.Loss | str | Callable[[Any, Any], Any]
ModelLike: TypeAlias = keras.Model | Callable[[], keras.Model]
OptimizerLike: TypeAlias = keras.optimizers.Optimizer | Callable[[], keras.optimizers.Optimizer]


class ReferenceUnavailable(RuntimeError):
    """The ``tf.distribute`` strategy itself cannot train this model/optimizer pair.

    Raised where a reference fails in a known, measured way (e.g. CentralStorageStrategy
    with BatchNormalization, or with Keras 3 Nadam), so that a test can tell "the
    reference is broken here" from "the code under test is wrong" and compare against
    :class:`reference.MirroredTrainer` instead.
    """


def per_example_loss(loss: LossLike, y_true: Any, y_pred: Any) -> tf.Tensor:
    """One loss value per example: a ``[batch]`` tensor.

    Args:
        loss: a ``keras.losses.Loss`` (its unreduced ``call`` is used, so its own
            reduction setting does not matter), a Keras loss name such as ``"mse"``,
            or any callable ``(y_true, y_pred) -> per-example losses``.
        y_true: targets.
        y_pred: model outputs.

    Returns:
        A rank-1 tensor of per-example losses. Losses of rank > 1 (e.g. per pixel)
        are averaged over their non-batch axes.

    Raises:
        ValueError: the loss returned a scalar (it reduced over the batch already).

    Example:
        >>> per_example_loss("mse", tf.zeros([2, 3]), tf.ones([2, 3])).numpy()
        array([1., 1.], dtype=float32)
    """
    fn = resolve_loss(loss)
    values = fn.call(y_true, y_pred) if isinstance(fn, keras.losses.Loss) else fn(y_true, y_pred)
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        raise ValueError(
            "loss must return one value per example (a [batch] tensor), got a scalar: "
            "pass an unreduced loss, e.g. keras.losses.MeanSquaredError() or a function "
            "(y_true, y_pred) -> per-example losses"
        )
    if values.shape.rank is not None and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values


def resolve_loss(loss: LossLike) -> keras.losses.Loss | Callable[[Any, Any], Any]:
    """A string loss name -> the Keras loss; a Loss or callable is returned as is.

    Raises:
        TypeError: ``loss`` is neither a string nor callable.
        ValueError: unknown loss name.
    """
    if isinstance(loss, str):
        return keras.losses.get(loss)
    if not callable(loss):
        raise TypeError(
            f"loss must be a keras.losses.Loss, a loss name or a callable "
            f"(y_true, y_pred) -> per-example losses, got {type(loss).__name__}"
        )
    return loss


def check_devices(devices: Sequence[str], argument: str = "devices") -> list[str]:
    """Validate device names and return them in canonical form (``/device:CPU:1``).

    Raises:
        TypeError: ``devices`` is a string or holds a non-string.
        ValueError: it is empty, holds a duplicate, or names a device TensorFlow does
            not have.
    """
    if isinstance(devices, str) or not isinstance(devices, Sequence):
        raise TypeError(f"{argument} must be a list of device names, got {devices!r}")
    if not devices:
        raise ValueError(f"{argument} must name at least one device, got an empty list")
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"{argument} must hold device names (str), got {d!r}")
    names = [canonical_device(d) for d in devices]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{argument} holds duplicate devices: {duplicates} (from {devices!r})")
    known = [canonical_device(d.name) for d in tf.config.list_logical_devices()]
    unknown = [d for d, n in zip(devices, names, strict=True) if n not in known]
    if unknown:
        raise ValueError(f"{argument}: unknown device(s) {unknown}; TensorFlow has {known}")
    return names


def _build_model(model: ModelLike) -> keras.Model:
    """Create the model in the current strategy scope (factory call or clone)."""
    if not isinstance(model, keras.Model):
        if not callable(model):
            raise TypeError(f"model must be a keras.Model or a factory, got {type(model)}")
        built = model()
        if not isinstance(built, keras.Model) or not built.built:
            raise ValueError(
                "the model factory must return a built keras.Model (give it a keras.Input "
                f"or call model.build(shape) inside the factory), got {built!r}"
            )
        return built
    if not model.built:
        raise ValueError(
            "model is not built, so it cannot be cloned into the strategy's scope: pass a "
            "factory (lambda: make_model()) or a built model (keras.Input / model.build)"
        )
    try:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
    except Exception as err:
        raise ValueError(
            f"could not clone {type(model).__name__} into the strategy's scope ({err}); "
            "pass a zero-argument factory that builds the model instead"
        ) from err
    return clone


def _build_optimizer(optimizer: OptimizerLike) -> keras.optimizers.Optimizer:
    """Create the optimizer in the current strategy scope (factory call or from_config)."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    if not callable(optimizer):
        raise TypeError(
            f"optimizer must be a keras.optimizers.Optimizer or a factory, got {optimizer!r}"
        )
    built = optimizer()
    if not isinstance(built, keras.optimizers.Optimizer):
        raise TypeError(f"the optimizer factory must return a Keras optimizer, got {built!r}")
    return built


def _tensors(value: Any) -> Any:
    """A nest of tensors; a top-level list becomes a tuple (tf.data would stack a list)."""
    if isinstance(value, list):
        value = tuple(value)
    return tf.nest.map_structure(tf.convert_to_tensor, value)


def _as_batch(x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, tf.Tensor, int]:
    """Tensors for one batch, with ``sample_weight`` defaulting to ones; checks sizes."""
    x, y = _tensors(x), _tensors(y)
    sw = None if sample_weight is None else tf.convert_to_tensor(sample_weight)
    sizes: dict[str, int] = {}
    for name, value in (("x", x), ("y", y), ("sample_weight", sw)):
        leaves = [] if value is None else tf.nest.flatten(value)
        if value is not None and not leaves:
            raise ValueError(f"{name} is empty: expected at least one array")
        for leaf in leaves:
            if leaf.shape.rank == 0:
                raise ValueError(f"{name} is a scalar: every input needs a batch dimension")
            if sizes.setdefault(name, int(leaf.shape[0])) != int(leaf.shape[0]):
                raise ValueError(f"{name}: its tensors have different leading dimensions")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"x and y (and sample_weight) must share their batch size, got {sizes}")
    if sw is None:
        sw = tf.ones([sizes["x"]])
    elif sw.shape.rank != 1:
        raise ValueError(f"sample_weight must have shape [batch], got {sw.shape}")
    return x, y, sw, sizes["x"]


class StrategyTrainer:
    """The custom training loop over a ``tf.distribute.Strategy`` (base of the references).

    Subclasses make the strategy and call ``super().__init__``. The model and the
    optimizer are created inside ``strategy.scope()``, and the optimizer is built
    there before the first step (without that, Keras 3 slot optimizers fail inside
    ``strategy.run``: keras-team/keras#19246).

    Attributes:
        model: the Keras model whose variables the strategy owns.
        optimizer: the Keras optimizer, built for ``model.trainable_variables``.
        strategy: the ``tf.distribute.Strategy``.
        loss_fn: the resolved loss (a step of :mod:`towers.testing.steps`).
        loss_denominator: ``"global"``: each replica divides its loss sum by the global
            batch (``compute_average_loss(..., global_batch_size=B)``), as a towers
            trainer's option of the same name says (read by :mod:`towers.testing.report`).

    Example:
        >>> strategy = tf.distribute.OneDeviceStrategy("/cpu:0")         # doctest: +SKIP
        >>> trainer = StrategyTrainer(strategy, make_model, keras.optimizers.SGD(0.1), "mse")
        >>> trainer.train_step(x, y)                                    # doctest: +SKIP
    """

    loss_denominator = "global"

    def __init__(
        self,
        strategy: tf.distribute.Strategy,
        model: ModelLike,
        optimizer: OptimizerLike,
        loss: LossLike,
    ) -> None:
        self.strategy = strategy
        self._loss = resolve_loss(loss)
        self.loss_fn = self._loss  # public, as TowerTrainer's (towers.testing sizes bounds)
        with strategy.scope():
            self.model = _build_model(model)
            if not self.model.trainable_variables:
                raise ValueError("model has no trainable variables: there is nothing to train")
            self.optimizer = _build_optimizer(optimizer)
            self.optimizer.build(self.model.trainable_variables)
        self._step = tf.function(self._distributed_step)

    def train_step(self, x: Any, y: Any, sample_weight: Any = None) -> tf.Tensor:
        """Run one synchronous step on the whole batch and return its global mean loss.

        Args:
            x: inputs (array, tensor, or a tuple/dict nest of them), batch-major.
            y: targets with the same leading dimension.
            sample_weight: optional ``[batch]`` weights (default: ones).

        Returns:
            A scalar tensor: Σ sample_weight·loss / batch + regularization losses.
            The step is traced once per input shape; each call also makes a fresh
            distributed iterator, which costs ~0.2 s on a 2-core CPU (the price of
            using TensorFlow's own split rather than re-implementing it).

        Raises:
            ValueError: the leading dimensions of ``x``, ``y``, ``sample_weight`` differ,
                or the loss returns a scalar.
        """
        x, y, sw, batch = _as_batch(x, y, sample_weight)
        dataset = tf.data.Dataset.from_tensors((x, y, sw))
        inputs = next(iter(self.strategy.experimental_distribute_dataset(dataset)))
        return self._step(inputs, tf.constant(batch, tf.int32))

    def get_weights(self) -> list[np.ndarray]:
        """The model's weights as NumPy arrays, in ``model.weights`` order."""
        return [np.array(v.numpy()) for v in self.model.weights]

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Assign every weight (every replica's copy), in ``model.weights`` order.

        Raises:
            ValueError: wrong number of arrays or a shape mismatch.
        """
        with self.strategy.scope():
            self.model.set_weights([np.asarray(w) for w in weights])

    def _distributed_step(self, inputs: tuple[Any, Any, Any], global_batch: tf.Tensor) -> Any:
        per_replica = self.strategy.run(self._replica_step, args=(*inputs, global_batch))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def _replica_step(self, x: Any, y: Any, sw: tf.Tensor, global_batch: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            per_ex = per_example_loss(self._loss, y, y_pred)
            loss = tf.nn.compute_average_loss(
                per_ex, sample_weight=tf.cast(sw, per_ex.dtype), global_batch_size=global_batch
            )
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
            # Keras 3's custom-loop contract: a LossScaleOptimizer scales the loss here and
            # unscales in apply_gradients; any other optimizer returns the loss unchanged.
            scaled = self.optimizer.scale_loss(loss)
        variables = self.model.trainable_variables
        grads = tape.gradient(scaled, variables)
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss
