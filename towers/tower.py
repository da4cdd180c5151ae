"""One tower: forward and backward on its shard, under its own device and tape.

Each tower computes its share of the *global* mean loss::

    loss_i = sum_k w_k * l(y_k, f(x_k)) / B_global  +  R(weights) / n_towers

where the sum runs over tower ``i``'s shard, ``w`` is the sample weight (1 when absent),
``B_global`` the whole batch's size and ``R`` the model's regularization losses: exactly
``tf.nn.compute_average_loss`` and ``tf.nn.scale_regularization_loss`` under a strategy
with ``n_towers`` replicas, so the towers' gradients add up to the gradient of the global
mean loss, uneven or empty shards included. A Keras loss's ``reduction`` changes the
divisor (:func:`loss_divisor`): 1 for ``"sum"``, the global sum of sample
weights for ``"mean_with_sample_weight"``.

The network runs through ``stateless_call`` (:func:`run_network`): the tower passes in
its replica's values and gets back the new non-trainable values, which the step combines
(:func:`towers.placement.combine_non_trainable`) instead of each tower overwriting
shared variables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

try:  # Keras's layer call context (private): where training=True reaches inner layers
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext
except ImportError:  # pragma: no cover - another Keras layout
    CallContext = None

from towers.allreduce.machinery.primitives import send
from towers.devices import canonical_device

__all__ = ["Gradients", "LossFn", "TowerResult", "empty_tower_step", "loss_divisor",
           "per_example_loss", "run_network", "static_dense_shapes", "tower_step",
           "weighs_elements"]


LossFn = Callable[[Any, Any], Any]
"""A loss: ``(y_true, y_pred) -> one value per example``."""


class TowerResult(NamedTuple):
    """What one tower hands to the reduction (all of it on the tower's device).

    Attributes:
        loss: the tower's share of the global mean loss (and of the regularization losses).
        grads: gradient of ``loss`` per trainable variable (``IndexedSlices`` stay
            sparse); empty when only the forward pass ran.
        non_trainable: the non-trainable values after this tower's forward pass.
        examples: how many examples the tower saw (an int32 scalar).
        outputs: the model's outputs on the tower's shard (training mode).
        changed: per non-trainable variable, whether this tower's forward pass assigned
            it (Python bools, known when traced; None: assume it did); state no tower
            changed keeps its value bitwise.
    """

    loss: tf.Tensor
    grads: list[tf.Tensor | tf.IndexedSlices]
    non_trainable: list[tf.Tensor]
    examples: tf.Tensor
    outputs: Any = None
    changed: tuple[bool, ...] | None = None


class Gradients(NamedTuple):
    """What ``TowerTrainer.forward_backward`` hands to ``reduce``: every tower's result.

    Attributes:
        towers: one :class:`TowerResult` per tower, in tower order (an empty tower
            contributes zeros, see :func:`empty_tower_step`).
    """

    towers: tuple[TowerResult, ...]

    @property
    def grads(self) -> list[list[tf.Tensor | tf.IndexedSlices]]:
        """``grads[tower][var]``, the all-reduce's input."""
        return [r.grads for r in self.towers]

    def on_devices(self, devices: Sequence[str]) -> Gradients:
        """Every tower's values on its device (``devices[tower]``).

        Within the step they are there already and come back as they are; a phase run
        alone may get them without a device (as ``tf.function`` arguments) or on the
        device a compiled phase returned them to.
        """

        def pin(value: Any, device: str) -> Any:
            if value is None or isinstance(value, bool):  # TowerResult.changed
                return value
            if canonical_device(value.device) == device:
                return value
            with tf.device(device):
                if isinstance(value, tf.IndexedSlices):
                    return tf.IndexedSlices(
                        tf.identity(value.values), tf.identity(value.indices), value.dense_shape
                    )
                return tf.identity(value)

        return Gradients(tuple(
            tf.nest.map_structure(functools.partial(pin, device=d), r)
            for r, d in zip(self.towers, devices)
        ))  # fmt: skip


def run_network(model: keras.Model, trainable: Sequence[tf.Tensor],
                non_trainable: Sequence[tf.Tensor], x: Any, training: bool) -> tuple:
    """``model`` on one replica's values, as its ``__call__`` runs it: the one way every
    tower runs the network, training or inferring (the layer state Keras keeps outside
    variables is ``model``'s own, so it holds on every tower).

    The model's own name scope, as ``__call__`` opens it under tf.distribute (Grappler reads
    the names: ``replica_scope``); ``training`` as an argument where ``call`` takes
    one and, when training, in Keras's layer call context, where inner layers look for it
    (``stateless_call`` calls ``call`` without one; where this Keras has none, nothing is set).

    Returns:
        ``(outputs, new non-trainable values, the model's losses)`` of ``stateless_call``.
    """
    given = {"training": training} if getattr(model, "_call_has_training_arg", True) else {}
    previous = None
    if training and CallContext is not None:  # Keras keeps the context in private state
        previous = global_state.get_global_attribute("current_call_ctx")
        context = CallContext(entry_layer=model)  # entered at model, as __call__ enters it
        context.training = True
        global_state.set_global_attribute("current_call_ctx", context)
    try:
        with keras.name_scope(model.name, caller=model):
            result: tuple = model.stateless_call(list(trainable), list(non_trainable), x,
                                                 return_losses=True, **given)  # fmt: skip
    finally:
        if training and CallContext is not None:
            global_state.set_global_attribute("current_call_ctx", previous)
    return result


def _forward(model: keras.Model, trainable: Sequence[tf.Tensor],
             non_trainable: Sequence[tf.Tensor], shard: tuple[Any, Any, Any], loss_fn: LossFn,
             global_batch: tf.Tensor, num_towers: int, reduction: str) -> TowerResult:  # fmt: skip
    """The forward pass and the tower's loss share (no gradients yet)."""
    x, y, sample_weight = shard
    y_pred, new_non_trainable, reg_losses = run_network(model, trainable, non_trainable, x, True)
    per_ex = per_example_loss(loss_fn, y, y_pred, sample_weight, reduction=reduction)
    if weighs_elements(sample_weight):  # weighed element by element above
        sample_weight = None
    if global_batch.dtype.is_integer:  # the batch size, or 1 (reduction "sum")
        loss = tf.nn.compute_average_loss(
            per_ex, sample_weight=sample_weight, global_batch_size=global_batch
        )
    else:  # the global sum of sample weights (reduction "mean_with_sample_weight")
        weighted = tf.nn.compute_average_loss(per_ex, sample_weight=sample_weight,
                                              global_batch_size=1)  # fmt: skip
        loss = tf.math.divide_no_nan(weighted, tf.cast(global_batch, weighted.dtype))
    if reg_losses:
        reg = tf.add_n(reg_losses)
        loss += reg / tf.cast(num_towers, reg.dtype)
    # stateless_call hands back the very tensor it was given for a variable nobody assigned
    changed = tuple(new is not old for new, old in zip(new_non_trainable, non_trainable))
    return TowerResult(loss, [], list(new_non_trainable), tf.shape(per_ex)[0], y_pred, changed)


# -- the loss: per example, and what a tower divides its sum by ---------------------------


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


def per_example_loss(
    loss_fn: LossFn, y_true: Any, y_pred: Any, sample_weight: Any = None, *,
    reduction: str = "sum_over_batch_size",
) -> tf.Tensor:
    """Per-example losses, shape ``[batch]``: extra axes (per timestep, per pixel) averaged,
    or added for Keras's ``reduction="sum"``. A weight per
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
        reduce = tf.reduce_sum if reduction == "sum" else tf.reduce_mean
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


def weighs_elements(sample_weight: Any) -> bool:
    """Whether ``sample_weight`` weighs a loss's elements rather than its examples
    (``[batch]`` or ``[batch, 1]``)."""
    shape = getattr(sample_weight, "shape", None)
    if shape is None:
        return False
    dims = list(shape)
    return len(dims) > 2 or (len(dims) == 2 and dims[1] != 1)


def tower_step(model: keras.Model, trainable: Sequence[tf.Tensor],
               non_trainable: Sequence[tf.Tensor], shard: tuple[Any, Any, Any], *,
               loss_fn: LossFn, global_batch: tf.Tensor, num_towers: int, device: str,
               backward: bool = True, loss_scale: tf.Tensor | None = None,
               jit_compile: bool = False, loss_reduction: str = "sum_over_batch_size",
               divisor_rule: str | float = "global") -> TowerResult:  # fmt: skip
    """Run forward and backward for one tower's shard on ``device``.

    Args:
        model: the Keras model (its variables are not touched; values come in).
        trainable, non_trainable: this tower's replica's values, in the order of
            ``model.trainable_variables`` and ``model.non_trainable_variables``.
        shard: ``(x, y, sample_weight)`` for this tower; ``sample_weight`` may be None.
        loss_fn: per-example loss (:mod:`towers.training.losses`).
        global_batch: what the tower's weighted loss sum is divided by: the batch size
            (an integer tensor), 1 (``"sum"``), or the global sum of sample weights.
        num_towers: number of towers (divides the regularization losses).
        device: this tower's device.
        backward: False runs the forward pass alone (no tape; ``grads`` is empty).
        loss_scale: a ``LossScaleOptimizer``'s dynamic scale ``S`` on ``device``, or None:
            the tape differentiates ``S·loss`` (Keras's ``scale_loss``); the gradients
            come back scaled (the optimizer unscales), the loss unscaled.
        jit_compile: the forward and backward pass as one XLA cluster on ``device``.
        loss_reduction: the loss's Keras reduction: ``"sum"`` adds a loss value's extra
            axes, every other averages them.
        divisor_rule: :attr:`~towers.guard.options.TowerOptions.divisor`: ``global_batch``
            (``"global"``), shard size × ``num_towers`` (``"per_replica"``) or a constant.
    """
    if divisor_rule == "per_replica":  # compute_average_loss's shape[0] × replicas
        global_batch = tf.shape(tf.nest.flatten(shard[0])[0])[0] * num_towers
    elif divisor_rule != "global":  # a constant: int32 when whole, as compute_average_loss
        constant = float(divisor_rule)
        global_batch = (tf.constant(int(constant), tf.int32) if constant.is_integer()
                        else tf.constant(constant, tf.float32))  # fmt: skip
    args = (model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers,
            loss_reduction)
    with tf.device(device):
        if jit_compile:
            result = _compiled(args, loss_scale, backward)
        else:
            result = _differentiate(args, loss_scale, backward)
    missing = [v.path for g, v in zip(result.grads, model.trainable_variables) if g is None]
    if missing:
        raise ValueError(f"no gradient for trainable variable(s) {', '.join(missing)}: they do "
                         "not influence the loss. Freeze them (trainable=False) or use them.")
    return result


def _differentiate(args: tuple, loss_scale: tf.Tensor | None, backward: bool) -> TowerResult:
    """The forward pass, and with ``backward`` the tape's gradients of (scaled) loss."""
    if not backward:
        return _forward(*args)
    with tf.GradientTape() as tape:
        tape.watch(list(args[1]))
        result = _forward(*args)
        target = result.loss
        if loss_scale is not None:
            target = keras.ops.multiply(target, loss_scale)  # LossScaleOptimizer.scale_loss
    grads = tape.gradient(target, list(args[1]))
    return result._replace(grads=list(grads))


def _compiled(args: tuple, loss_scale: tf.Tensor | None, backward: bool) -> TowerResult:
    """:func:`_differentiate` as one XLA cluster (``tf.function(jit_compile=True)``).

    ``changed`` is a trace-time fact about tensor identity inside the function, so it
    is read there and handed out beside the compiled outputs."""
    model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers, reduction = args
    seen: dict[str, Any] = {}

    def run(trainable: list, non_trainable: list, shard: Any, global_batch: tf.Tensor,
            loss_scale: tf.Tensor | None) -> TowerResult:
        inner = (model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers,
                 reduction)
        result = _differentiate(inner, loss_scale, backward)
        seen["changed"] = result.changed
        return result._replace(changed=None)

    compiled = tf.function(run, jit_compile=True, autograph=False)
    result = compiled(list(trainable), list(non_trainable), shard, global_batch, loss_scale)
    grads = static_dense_shapes(result.grads, trainable)
    return result._replace(grads=grads, changed=seen["changed"])


def static_dense_shapes(grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
    """``grads`` with each ``IndexedSlices``'s ``dense_shape`` its variable's static shape:
    one that left a ``tf.function`` (an output, an argument) is a tensor of unknown value,
    and a densifying reducer needs the shape."""
    out = []
    for g, var in zip(grads, variables):
        if isinstance(g, tf.IndexedSlices) and var.shape.is_fully_defined():
            dtype = tf.int64 if g.dense_shape is None else g.dense_shape.dtype
            g = tf.IndexedSlices(g.values, g.indices, tf.constant(var.shape.as_list(), dtype))
        out.append(g)
    return out


def _zeros_like_gradient(variable: Any, like: Any) -> tf.Tensor | tf.IndexedSlices:
    if isinstance(like, tf.IndexedSlices):
        rows = tf.zeros([0, *variable.shape[1:]], like.values.dtype)
        return tf.IndexedSlices(rows, tf.zeros([0], like.indices.dtype), like.dense_shape)
    return tf.zeros(variable.shape, like.dtype)


def empty_tower_step(model: keras.Model, trainable: Sequence[tf.Tensor],
                     non_trainable: Sequence[tf.Tensor], *, template: TowerResult,
                     num_towers: int, device: str, loss_scale: tf.Tensor | None = None,
                     ) -> TowerResult:  # fmt: skip
    """What a tower without examples contributes, without running the model on 0 rows.

    Its data loss is 0, but it still owes its share ``R / n_towers`` of the
    regularization losses (the reference's empty replica computes it too), so those
    gradients are taken from the regularizers alone. Everything else is zero; sparse
    gradients stay sparse (an ``IndexedSlices`` with no rows), state stays unchanged.
    Skipping the forward pass matters: some kernels fail on a batch of 0 (Keras 3
    Conv2D does, in the reference as well). ``loss_scale`` scales those gradients as
    :func:`tower_step` does.
    """
    with tf.device(device):
        mapping = list(zip(model.trainable_variables, trainable))
        with tf.GradientTape() as tape:
            tape.watch(list(trainable))
            with keras.StatelessScope(state_mapping=mapping):
                reg_losses = list(model.losses)
            loss = tf.zeros([], template.loss.dtype)
            if reg_losses:
                reg = tf.add_n(reg_losses)
                loss += reg / tf.cast(num_towers, reg.dtype)
            target = loss if loss_scale is None else keras.ops.multiply(loss, loss_scale)
        grads = tape.gradient(target, list(trainable)) if reg_losses else [None] * len(trainable)
        grads = [_zeros_like_gradient(v, like) if g is None else g
                 for g, v, like in zip(grads, model.trainable_variables, template.grads)]
        outputs = tf.nest.map_structure(lambda t: t[:0], template.outputs)
        return TowerResult(loss, grads, list(non_trainable), tf.constant(0, tf.int32), outputs,
                           (False,) * len(non_trainable))  # fmt: skip
