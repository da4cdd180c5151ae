"""The trainer's arguments and a step's batch, checked before anything is traced.

Each check raises ``TypeError`` (the wrong kind of object) or ``ValueError`` (the right
kind, a wrong value) naming the argument and what was expected, so a mistake never
surfaces as a raw TensorFlow error from inside the traced step. docs/bad_inputs.md
lists every case the tests hold, with the error it gets.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers.split import Shards, check_batch, shard_sizes

__all__ = [
    "KERAS_STEPS", "batch_tensors", "check_batch_against_model", "check_keras_steps", "check_kinds",
    "check_shards",
]

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


# -- a batch ------------------------------------------------------------------------------------

_NUMERIC = "biuf"  # NumPy dtype kinds a model and a loss can take


def _leaf_dtype_and_shape(name: str, leaf: Any) -> tuple[tf.DType | np.dtype, tuple]:
    """A batch element's dtype and shape, without converting a tensor."""
    if isinstance(leaf, tf.RaggedTensor):
        raise TypeError(f"{name} is a tf.RaggedTensor: pad it to a dense tensor (.to_tensor())")
    if isinstance(leaf, tf.SparseTensor):
        raise TypeError(f"{name} is a tf.SparseTensor: densify it (tf.sparse.to_dense)")
    if isinstance(leaf, (tf.Tensor, tf.Variable)):
        return leaf.dtype, tuple(leaf.shape)
    if isinstance(leaf, (tf.data.Dataset, Iterator)) or callable(leaf):
        raise TypeError(
            f"{name} must be arrays or tensors (one batch); got {type(leaf).__name__}: "
            "use towers.TowerModel.fit for a dataset or a generator"
        )
    try:
        array = np.asarray(leaf)
    except ValueError as err:  # NumPy refuses rows of different lengths
        raise ValueError(f"{name} is ragged (rows of different lengths): pad it ({err})") from err
    return array.dtype, array.shape


def _dtype_kind(dtype: Any) -> str:
    """A NumPy-style kind letter for a NumPy or TensorFlow dtype."""
    if isinstance(dtype, tf.DType):
        if dtype == tf.string:
            return "S"
        if dtype.is_bool:
            return "b"
        if dtype.is_integer:
            return "i"
        return "f" if dtype.is_floating else "c" if dtype.is_complex else "O"
    return str(np.dtype(dtype).kind)


def _check_dtype(name: str, dtype: Any, allow_strings: bool = False) -> None:
    kind = _dtype_kind(dtype)
    if kind in "SU" and allow_strings:
        return
    if kind not in _NUMERIC:
        what = "strings" if kind in "SU" else f"dtype {dtype}"
        raise TypeError(
            f"{name} holds {what}: expected numbers (booleans, integers or floats)"
            + ("; encode strings first, e.g. keras.layers.StringLookup" if kind in "SU" else "")
        )


def _model_io(model: keras.Model, which: str) -> Any:
    """The model's ``"input"`` or ``"output"`` structure of KerasTensors, or None (a
    subclassed model)."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        return None


def _check_x(x: Any, model: keras.Model) -> None:
    expected = _model_io(model, "input")
    if expected is None:
        return
    if isinstance(expected, dict):
        if not isinstance(x, dict):
            raise ValueError(
                f"x must be a dict with keys {sorted(expected)}; got {type(x).__name__}"
            )
        missing, extra = sorted(set(expected) - set(x)), sorted(set(x) - set(expected))
        if missing:
            raise ValueError(f"x is missing the model's input(s) {missing}; it has {sorted(x)}")
        if extra:
            raise ValueError(f"x has key(s) {extra} the model has no input for; inputs: "
                             f"{sorted(expected)}")  # fmt: skip
        pairs = [(f"x[{k!r}]", x[k], expected[k]) for k in sorted(expected)]
    else:
        flat = tf.nest.flatten(expected)
        # a list is one array per input, except a plain nested list for a one-input model
        listed = isinstance(x, (list, tuple)) and (
            len(flat) > 1 or all(hasattr(leaf, "shape") for leaf in x)
        )
        leaves = list(x) if listed else [x]
        if len(leaves) != len(flat):
            raise ValueError(f"x has {len(leaves)} arrays; the model takes {len(flat)} input(s)")
        one = not listed
        pairs = [
            ("x" if one else f"x[{i}]", leaf, t) for i, (leaf, t) in enumerate(zip(leaves, flat))
        ]
    for name, leaf, tensor in pairs:
        dtype, shape = _leaf_dtype_and_shape(name, leaf)
        _check_dtype(name, dtype, allow_strings=tensor.dtype == "string")
        want = tuple(tensor.shape)
        if len(shape) != len(want) or any(w is not None and w != s for s, w in
                                          zip(shape[1:], want[1:])):  # fmt: skip
            raise ValueError(
                f"{name} has shape {list(shape)}; the model's input {tensor.name!r} takes "
                f"{['batch', *want[1:]]}"
            )


def check_batch_against_model(x: Any, y: Any, sample_weight: Any, model: keras.Model) -> None:
    """Check a step's batch before it is traced: present, numeric, dense, fitting the model.

    Raises:
        TypeError: a ragged or sparse tensor, strings or objects where numbers are
            needed, a dataset or generator instead of one batch, a dict of sample weights.
        ValueError: ``x`` or ``y`` is None or empty; a dict input missing a key (or with an
            extra one); a feature shape, rank or input count that does not fit the model;
            ``y`` a dict for a model with one output.
    """
    if x is None:
        raise ValueError("x is None: pass the batch's inputs (arrays or tensors)")
    if y is None:
        raise ValueError("y is None: train_step needs the targets the loss compares with")
    if isinstance(x, dict) or _model_io(model, "input") is not None:
        _check_x(x, model)
    else:
        for i, leaf in enumerate(tf.nest.flatten(x)):
            _check_dtype(f"x[{i}]", _leaf_dtype_and_shape(f"x[{i}]", leaf)[0], True)
    output = _model_io(model, "output")
    outputs = len(output) if isinstance(output, dict | list | tuple) else 1
    # Keras's per-output forms, a dict or one array per output (fit(..., sample_weight=[w_a,
    # w_b])): refused, not read as one [outputs, batch] array (a batch-size or TF error)
    per_output = "a dict" if isinstance(sample_weight, dict) else (
        f"a {type(sample_weight).__name__} of {outputs} arrays, one per output"
        if outputs > 1 and isinstance(sample_weight, list | tuple)
        and len(sample_weight) == outputs
        and all(isinstance(w, list | tuple) or len(getattr(w, "shape", ())) >= 1
                for w in sample_weight) else None)  # fmt: skip
    if per_output:
        raise TypeError(f"sample_weight must be an array (one weight per example), got "
                        f"{per_output}: per-output sample weights are not supported; one array "
                        "weighs every output's loss")
    if isinstance(y, dict) and output is not None and not isinstance(output, dict | list | tuple):
        raise ValueError(f"y is a dict (keys {sorted(y, key=str)}); the model has one output")
    for name, part in (("y", y), ("sample_weight", sample_weight)):
        if part is None:
            continue
        leaves = tf.nest.flatten(part)
        if not leaves:
            raise ValueError(f"{name} is empty ({part!r}): expected arrays or tensors")
        for i, leaf in enumerate(leaves):
            label = name if len(leaves) == 1 else f"{name}[{i}]"
            _check_dtype(label, _leaf_dtype_and_shape(label, leaf)[0])


def batch_tensors(
    x: Any, y: Any, sample_weight: Any, model: keras.Model, *, allow_empty: bool = False
) -> tuple[Any, Any, Any]:
    """A step's batch, checked (:func:`check_batch_against_model`, equal lengths, non-zero
    unless ``allow_empty``) and converted to tensors; ``sample_weight`` takes the model's
    float dtype.
    """
    check_batch_against_model(x, y, sample_weight, model)
    check_batch(x, y, sample_weight, allow_empty=allow_empty)
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.nest.map_structure(tf.convert_to_tensor, y)
    if sample_weight is not None:
        dtype = tf.as_dtype(model.trainable_variables[0].dtype)
        sample_weight = tf.convert_to_tensor(sample_weight, dtype=dtype)
    return x, y, sample_weight


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
