"""One tower: forward and backward on its shard, under its own device and tape.

Each tower computes its share of the *global* mean loss::

    loss_i = sum_k w_k * l(y_k, f(x_k)) / B_global  +  R(weights) / n_towers

where the sum runs over tower ``i``'s shard, ``w`` is the sample weight (1 when
absent), ``B_global`` is the whole batch's size and ``R`` is the model's
regularization losses. These are exactly ``tf.nn.compute_average_loss`` and
``tf.nn.scale_regularization_loss`` under a strategy with ``n_towers`` replicas,
so the towers' gradients add up to the gradient of the global mean loss, and an
uneven or empty shard is weighted correctly. A Keras loss's ``reduction`` changes the
divisor ``B_global`` (:data:`REDUCTIONS`, :func:`loss_divisor`): 1 for ``"sum"``, the
global sum of sample weights for ``"mean_with_sample_weight"``.

The model runs through Keras' ``stateless_call``: the tower passes in its own
copy of the variable values and gets back the updated non-trainable values
(BatchNormalization statistics, dropout seed state) instead of letting each
tower overwrite the shared variables. The trainer then decides how to combine
them (see :mod:`towers.step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

try:  # Keras's layer call context (private): where training=True reaches inner layers
    from keras.src.backend.common import global_state
    from keras.src.layers.layer import CallContext
except ImportError:  # pragma: no cover - another Keras layout
    CallContext = None

from towers.allreduce.machinery.primitives import send
from towers.allreduce.parameter_device import reduce_on
from towers.devices import canonical_device

__all__ = [
    "REDUCTIONS",
    "Gradients",
    "LossFn",
    "TowerResult",
    "combine_non_trainable",
    "empty_tower_step",
    "extra_axes",
    "loss_divisor",
    "loss_reduction",
    "per_example_loss",
    "resolve_loss",
    "tower_step",
    "weighs_elements",
]

LossFn = Callable[[Any, Any], Any]

REDUCTIONS = ("sum_over_batch_size", "sum", "mean", "mean_with_sample_weight")
"""The Keras loss reductions a trainer honours, each over the *global* batch (what one
device computes on the whole batch; ``keras.losses.Loss(reduction=...)``):
``sum_over_batch_size`` (the default) and ``mean`` (the same in Keras): ``Σ w·l / B``;
``sum``: ``Σ w·l``; ``mean_with_sample_weight``: ``Σ w·l / Σ w`` with sample weights,
``Σ w·l / B`` without. ``"none"`` (or None) leaves a vector a trainer cannot
differentiate: refused."""


class TowerResult(NamedTuple):
    """What one tower hands to the reduction (all of it on the tower's device).

    Attributes:
        loss: the tower's share of the global mean loss (its losses / global batch,
            plus its share of the regularization losses).
        grads: gradient of ``loss`` per trainable variable (``IndexedSlices`` stay
            sparse); empty when only the forward pass ran.
        non_trainable: the non-trainable values after this tower's forward pass
            (BatchNormalization statistics, seed state), per non-trainable variable.
        examples: how many examples the tower saw (an int32 scalar).
        outputs: the model's outputs on the tower's shard (training mode).
        changed: per non-trainable variable, whether this tower's forward pass assigned
            it (Python bools, known when traced; None: assume it did). A variable no
            tower changed (a frozen layer's weights) keeps its value bitwise.
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

    Raises:
        ValueError: ``"none"``/None (no scalar to train on) or a reduction not in
            :data:`REDUCTIONS`, naming ``loss`` and the reduction.
    """
    if isinstance(loss, str):
        loss = None if loss.lower() in CROSSENTROPY else keras.losses.get(loss)
    if not isinstance(loss, keras.losses.Loss):
        return REDUCTIONS[0]
    reduction = loss.reduction
    if reduction is None or reduction == "none":
        raise ValueError(
            f"loss: {type(loss).__name__} has reduction={reduction!r}, which returns one "
            "value per example, not a scalar to train on; use reduction="
            "'sum_over_batch_size' (the default), 'sum', 'mean' or 'mean_with_sample_weight'"
        )
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
        ValueError: the loss returned a scalar; an element weight's shape is not the loss
            values' (a multi-output loss has one value per example).
    """
    values = tf.convert_to_tensor(loss_fn(y_true, y_pred))
    if values.shape.rank == 0:
        raise ValueError(
            "loss must return one value per example (shape [batch]), but it returned a "
            "scalar: pass an unreduced loss, e.g. keras.losses.SparseCategoricalCrossentropy() "
            "(towers calls its .call) or a function of (y_true, y_pred) without a mean"
        )
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


def _check_gradients(grads: Sequence[Any], names: Sequence[str]) -> None:
    missing = [name for g, name in zip(grads, names) if g is None]
    if missing:
        raise ValueError(
            "no gradient for trainable variable(s) "
            + ", ".join(missing)
            + ": they do not influence the loss. Freeze them (trainable=False) or use them."
        )


@contextlib.contextmanager
def _training_context(model: keras.Model) -> Iterator[None]:
    """Keras's layer call context with ``training=True``, entered at ``model`` as its
    ``__call__`` enters it (``stateless_call`` calls ``call`` without one). Keras keeps the
    context in private state: where this Keras has none, nothing is set."""
    if CallContext is None:  # pragma: no cover - another Keras layout
        yield
        return
    previous = global_state.get_global_attribute("current_call_ctx")
    context = CallContext(entry_layer=model)
    context.training = True
    global_state.set_global_attribute("current_call_ctx", context)
    try:
        yield
    finally:
        global_state.set_global_attribute("current_call_ctx", previous)


def _forward(
    model: keras.Model,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    shard: tuple[Any, Any, Any],
    loss_fn: LossFn,
    global_batch: tf.Tensor,
    num_towers: int,
    axes: str,
) -> TowerResult:
    """The forward pass and the tower's loss share (no gradients yet)."""
    x, y, sample_weight = shard
    # the model's own name scope, as its __call__ opens it under tf.distribute: the ops then
    # carry the strategy's names (Grappler reads them: ordering.replica_scope), and a layer
    # named "_x" is not a root scope, which TensorFlow refuses
    # training=True as model.__call__ passes it: as an argument where call takes one, and in
    # Keras's call context, where the inner layers look for it (a subclassed call that does
    # not hand it to its Dropout)
    given = {"training": True} if getattr(model, "_call_has_training_arg", True) else {}
    with keras.name_scope(model.name, caller=model), _training_context(model):
        y_pred, new_non_trainable, reg_losses = model.stateless_call(
            list(trainable), list(non_trainable), x, return_losses=True, **given
        )
    per_ex = per_example_loss(loss_fn, y, y_pred, sample_weight, extra_axes=axes)
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


def tower_step(
    model: keras.Model,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    shard: tuple[Any, Any, Any],
    *,
    loss_fn: LossFn,
    global_batch: tf.Tensor,
    num_towers: int,
    device: str,
    backward: bool = True,
    loss_scale: tf.Tensor | None = None,
    jit_compile: bool = False,
    loss_reduction: str = "sum_over_batch_size",
) -> TowerResult:
    """Run forward and backward for one tower's shard on ``device``.

    Args:
        model: the Keras model (its variables are not touched; values come in).
        trainable: this tower's copy of the trainable values, in ``model.trainable_variables``
            order.
        non_trainable: likewise for ``model.non_trainable_variables``.
        shard: ``(x, y, sample_weight)`` for this tower; ``sample_weight`` may be None.
        loss_fn: per-example loss, see :func:`resolve_loss`.
        global_batch: what the tower's weighted loss sum is divided by: the whole
            batch's size (an integer tensor), 1 for a ``"sum"`` reduction, or the global
            sum of sample weights (a float tensor); see :func:`loss_divisor`.
        num_towers: number of towers (divides the regularization losses).
        device: this tower's device.
        backward: False runs the forward pass alone (no tape; ``grads`` is empty),
            e.g. to time it.
        loss_scale: the dynamic loss scale ``S`` of a ``LossScaleOptimizer`` (on
            ``device``), or None. The tape differentiates ``S·loss`` — Keras'
            ``optimizer.scale_loss`` — so float16 gradients do not underflow; the
            gradients come back scaled (the optimizer unscales), the loss unscaled.
        jit_compile: compile the forward and backward pass as one XLA cluster on
            ``device`` (``TowerTrainer(jit_compile=True)``; docs/xla.md gives its bound).
        loss_reduction: the loss's Keras reduction (:data:`REDUCTIONS`): ``"sum"`` adds a
            loss value's extra axes, every other averages them (:func:`per_example_loss`).

    Returns:
        The tower's loss share, gradients (``IndexedSlices`` stay sparse), updated
        non-trainable values and example count.
    """
    args = (model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers,
            extra_axes(loss_reduction))
    with tf.device(device):
        if jit_compile:
            result = _compiled(args, loss_scale, backward)
        else:
            result = _differentiate(args, loss_scale, backward)
    if backward:
        _check_gradients(result.grads, [v.path for v in model.trainable_variables])
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
    model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers, axes = args
    seen: dict[str, Any] = {}

    def run(trainable: list, non_trainable: list, shard: Any, global_batch: tf.Tensor,
            loss_scale: tf.Tensor | None) -> TowerResult:
        inner = (model, trainable, non_trainable, shard, loss_fn, global_batch, num_towers, axes)
        result = _differentiate(inner, loss_scale, backward)
        seen["changed"] = result.changed
        return result._replace(changed=None)

    compiled = tf.function(run, jit_compile=True, autograph=False)
    result = compiled(list(trainable), list(non_trainable), shard, global_batch, loss_scale)
    # a sparse gradient's dense_shape leaves the function as a tensor: give back the static
    # shape (a densifying reducer needs it)
    grads = [tf.IndexedSlices(g.values, g.indices,
                              tf.constant(w.shape.as_list(), g.dense_shape.dtype))
             if isinstance(g, tf.IndexedSlices) else g for g, w in zip(result.grads, trainable)]
    return result._replace(grads=grads, changed=seen["changed"])


def _zeros_like_gradient(variable: Any, like: Any) -> tf.Tensor | tf.IndexedSlices:
    if isinstance(like, tf.IndexedSlices):
        rows = tf.zeros([0, *variable.shape[1:]], like.values.dtype)
        return tf.IndexedSlices(rows, tf.zeros([0], like.indices.dtype), like.dense_shape)
    return tf.zeros(variable.shape, like.dtype)


def empty_tower_step(
    model: keras.Model,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    *,
    template: TowerResult,
    num_towers: int,
    device: str,
    loss_scale: tf.Tensor | None = None,
) -> TowerResult:
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
        grads = [
            _zeros_like_gradient(v, like) if g is None else g
            for g, v, like in zip(grads, model.trainable_variables, template.grads)
        ]
        outputs = tf.nest.map_structure(lambda t: t[:0], template.outputs)
        return TowerResult(loss, grads, list(non_trainable), tf.constant(0, tf.int32), outputs,
                           (False,) * len(non_trainable))  # fmt: skip


def _unchanged(results: Sequence[TowerResult], j: int) -> bool:
    """No tower changed non-trainable variable ``j`` (known when traced)."""
    return all(r.changed is not None and r.changed[j] is False for r in results)


def combine_non_trainable(
    results: Sequence[TowerResult], *, first_tower: bool, device: str
) -> list[tf.Tensor]:
    """One new value per non-trainable variable, formed on ``device``.

    Floating state is averaged over the towers that saw examples (an empty tower's
    unchanged copy would drag the mean back), or taken from tower 0 when
    ``first_tower`` (what MirroredStrategy shows when read). Integer state (seed
    counters) advances identically on every tower: tower 0's is kept, and so is
    state no tower changed (a frozen layer's weights: the mean of ``n`` equal values
    is not always bitwise that value, e.g. ``(x + x + x) / 3``).
    """
    combined = []
    with tf.device(device):
        counts = [send(r.examples, device, note="state") for r in results]
        for j in range(len(results[0].non_trainable)):
            values = [r.non_trainable[j] for r in results]
            if first_tower or not values[0].dtype.is_floating or _unchanged(results, j):
                combined.append(send(values[0], device, note="state"))
                continue
            masked = [
                tf.where(c > 0, send(v, device, note="state"), tf.zeros_like(v))
                for v, c in zip(values, counts)
            ]
            seen = tf.add_n([tf.cast(c > 0, values[0].dtype) for c in counts])
            combined.append(reduce_on(masked, device, "sum") / seen)
    return combined
