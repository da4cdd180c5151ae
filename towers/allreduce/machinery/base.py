"""The all-reduce contract, shared checks and the element-wise reductions.

An all-reduce algorithm is any callable with this signature::

    algorithm(values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]

``values`` holds one tensor per tower, all of one shape and dtype, each placed on
its own device. The result has as many tensors as ``values``; output ``i`` is on
input ``i``'s device and every output holds the same reduction. Configurable
algorithms are factories returning such a callable (``ring(subchunks=2)``).

``op`` is ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"product"``. Algorithms combine pairs
with :func:`combine` (``"mean"`` combines as a sum) and finish each output with
:func:`finish` (``"mean"`` divides by the tower count). Integer means are refused.

An algorithm adds in the order it is written only if TensorFlow keeps that order: inside a
``tf.function``, Grappler's arithmetic optimizer regroups trees of ``Add``/``AddN`` on one
device into one ``AddN`` with its inputs in an order of its choosing, and constant folding
turns ``x / n`` into ``x * (1/n)``: a few ULPs each. So towers runs its reductions (and,
by default, its update) inside :func:`as_written`. The names of the towers' ops matter
too (:func:`replica_scope`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

from towers.devices import canonical_device
from towers.guard.arguments import check_choice

__all__ = [
    "ALL_OPS",
    "DTYPES",
    "OPS",
    "REWRITES",
    "AllReduce",
    "GradientReducer",
    "StatefulReducer",
    "as_written",
    "callers_rewrites",
    "check_op",
    "check_scale",
    "check_values",
    "combine",
    "device_of",
    "finish",
    "replica_scope",
    "rewrites",
    "scale",
    "scoped_tower",
]

OPS = ("sum", "mean", "max", "min")
"""The reductions every check draws (``check_all_reduce``, ``towers check``)."""
ALL_OPS = (*OPS, "product")
"""Every reduction an algorithm accepts (the checks' error bounds do not model ``product``)."""
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)


@runtime_checkable
class AllReduce(Protocol):
    """Per-tower tensors in, per-tower reduced tensors out (output i on input i's device)."""

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]: ...


@runtime_checkable
class GradientReducer(Protocol):
    """Reduces *all* of a step's dense gradients at once: ``grads[tower][var]`` in, same out.

    For reducers that see every gradient together (buckets, compression with per-variable
    state); ``build`` runs once, eagerly, before the first step, so it can create variables.
    """

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None: ...

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]: ...


@runtime_checkable
class StatefulReducer(GradientReducer, Protocol):
    """A :class:`GradientReducer` with state (error feedback, PowerSGD's ``Q``) that changes
    exactly when the step's update is applied.

    A step whose update does not happen (skipped by the non-finite guard, a
    ``LossScaleOptimizer`` overflow, a timed-out collective) leaves every state variable
    bitwise as it was; otherwise an overflow's Inf lands in the error feedback and every
    later step overflows too. So the trainer computes the new state in its reduce phase and
    assigns it in its apply phase, under the update's own condition::

        reduce:  outs, new_state = reducer.reduce_deferred(grads)      nothing assigned
        apply:   tf.cond(applied, commit(new_state), no-op)            with the update

    ``reduce_gradients`` (outside a trainer) is ``reduce_deferred`` then ``commit``.
    """

    def reduce_deferred(
        self, grads: Sequence[Sequence[tf.Tensor]]
    ) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
        """``(reduced[tower][var], new_state)``: ``new_state`` one tensor per state
        variable, in a fixed order that ``commit`` knows; no variable is assigned."""
        ...

    def commit(self, new_state: Sequence[tf.Tensor]) -> None:
        """Assign ``new_state`` (from ``reduce_deferred``, same graph) to the state."""
        ...


def device_of(value: tf.Tensor | tf.IndexedSlices, what: str = "values[0]") -> str:
    """The canonical device of a value; a clear error naming ``what`` when it has none (a
    bare graph input)."""
    device = canonical_device(value.device)
    if not device:
        hint = ", or pass devices= to towers.all_reduce" if what.startswith("values") else ""
        raise ValueError(f"{what} has no device: create it under tf.device(...) (inside "
                         f"tf.function, a slice or argument needs its own tf.device block){hint}")
    return device


def check_op(op: str, dtype: tf.DType | None = None) -> str:
    """Validate ``op`` (and that ``mean`` is not asked of an integer dtype)."""
    if op not in ALL_OPS:
        check_choice("op", op, ALL_OPS)
    if op == "mean" and dtype is not None and dtype.is_integer:
        raise ValueError(f"op='mean' is not defined for integer dtype {dtype.name}: use 'sum'")
    return op


def check_scale(name: str, factor: object, dtype: tf.DType) -> float | int:
    """Validate a pre- or post-scaling ``factor`` for values of ``dtype``; return it.

    A factor is a finite real number (a bool is not one); an integer dtype takes only
    an integer factor, since multiplying in that dtype cannot round to a fraction.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(factor).__name__}")
    if not np.isfinite(factor):
        raise ValueError(f"{name} must be finite, got {factor!r}")
    if dtype.is_integer and float(factor) != int(factor):
        raise ValueError(f"{name}={factor!r} is not an integer: values of integer dtype "
                         f"{dtype.name} can only be scaled by an integer")
    return int(factor) if dtype.is_integer else float(factor)


def scale(value: tf.Tensor | tf.IndexedSlices, factor: float | int
          ) -> tf.Tensor | tf.IndexedSlices:
    """``value * factor`` in ``value``'s dtype, on its device (``factor`` 1: ``value`` itself)."""
    if factor == 1:
        return value
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(scale(value.values, factor), value.indices, value.dense_shape)
    with tf.device(value.device):
        return value * tf.constant(factor, value.dtype)


def check_values(values: Sequence[tf.Tensor | tf.IndexedSlices], op: str = "sum", *,
                 name: str = "values", rows: bool = False) -> list[str]:
    """Check the per-tower values of one collective and return their canonical devices
    (``name``: the argument, as errors call it; ``rows``: values concatenated on axis 0,
    whose lengths may differ).

    Raises:
        ValueError: an empty list, differing shapes or dtypes (naming the towers),
            an unsupported dtype, two values on one device, or a bad ``op``.
        TypeError: a value that is not a tensor.
    """
    if isinstance(values, (tf.Tensor, tf.IndexedSlices)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list with one tensor per tower")
    if not values:
        raise ValueError(f"{name} is empty: expected one tensor per tower")
    shapes = []
    for i, v in enumerate(values):
        if not isinstance(v, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
            raise TypeError(f"{name}[{i}] must be a tf.Tensor, got {type(v).__name__}")
        if rows and v.shape.rank == 0:
            raise ValueError(f"{name}[{i}] is a scalar: {name} are concatenated on axis 0")
        if rows:
            shapes.append(v.shape[1:])
        elif isinstance(v, tf.IndexedSlices):  # its rows' shape, when it has a dense shape
            shapes.append(tf.TensorShape(None) if v.dense_shape is None else v.values.shape[1:])
        else:
            shapes.append(v.shape)
    first = values[0]
    if first.dtype not in DTYPES:
        names = ", ".join(d.name for d in DTYPES)
        raise ValueError(f"dtype {first.dtype.name} is not supported; use one of {names}")
    differ = "differ beyond axis 0" if rows else "differ in shape"
    for i, v in enumerate(values[1:], start=1):
        if v.dtype != first.dtype:
            raise ValueError(f"{name} differ in dtype: tower 0 has {first.dtype.name}, "
                             f"tower {i} {v.dtype.name}")
        if not shapes[i].is_compatible_with(shapes[0]):
            raise ValueError(f"{name} {differ}: tower 0 has {shapes[0]}, tower {i} {shapes[i]}")
    check_op(op, first.dtype)
    devices = [device_of(v, f"{name}[{i}]") for i, v in enumerate(values)]
    seen: dict[str, int] = {}
    for i, d in enumerate(devices):
        if d in seen:
            raise ValueError(f"{name}[{seen[d]}] and {name}[{i}] are both on {d}: one per device")
        seen[d] = i
    return devices


def combine(a: tf.Tensor, b: tf.Tensor, op: str) -> tf.Tensor:
    """``a (op) b`` element-wise, in that order; ``mean`` combines as a sum."""
    if op in ("sum", "mean"):
        return a + b
    if op == "max":
        return tf.maximum(a, b)
    if op == "min":
        return tf.minimum(a, b)
    if op == "product":
        return a * b
    raise ValueError(f"op must be one of {', '.join(ALL_OPS)}; got {op!r}")


def finish(reduced: tf.Tensor, op: str, n: int) -> tf.Tensor:
    """Turn a fully combined value into the result: ``mean`` divides by ``n``."""
    if op == "mean":
        return reduced / tf.constant(n, dtype=reduced.dtype)
    return reduced


REWRITES = ("arithmetic_optimization", "constant_folding")
"""The Grappler passes that change the order or form of floating-point arithmetic."""

_CALLERS: list[dict[str, Any]] = []
"""The settings each open :func:`as_written` block replaced, innermost last."""

@contextlib.contextmanager
def rewrites(settings: dict[str, Any]) -> Iterator[None]:
    """Run ``tf.function`` calls in the block with the :data:`REWRITES` set to ``settings``
    (TensorFlow's process-wide optimizer setting; None: the default), restored after."""
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(settings)
    try:
        yield
    finally:  # None restores TensorFlow's default for a pass nobody had set
        tf.config.optimizer.set_experimental_options({name: before.get(name) for name in REWRITES})


@contextlib.contextmanager
def as_written() -> Iterator[None]:
    """Run ``tf.function`` calls in the block without the :data:`REWRITES` (other code keeps
    Grappler's defaults).

    Example:
        >>> with as_written():                  # doctest: +SKIP
        ...     out = my_function(x)
    """
    _CALLERS.append(tf.config.optimizer.get_experimental_options())
    try:
        with rewrites({name: False for name in REWRITES}):
            yield
    finally:
        _CALLERS.pop()


def callers_rewrites() -> dict[str, Any]:
    """The :data:`REWRITES` settings outside the innermost :func:`as_written` block (the
    caller's, while towers traces its update), else the current ones; None: the default."""
    source = _CALLERS[-1] if _CALLERS else tf.config.optimizer.get_experimental_options()
    return {name: source.get(name) for name in REWRITES}


_REPLICA = re.compile(r"replica_(\d+)$")


def replica_scope(tower: int) -> Any:
    """The name scope of tower ``tower``'s ops: ``MirroredStrategy``'s replicas' names
    (replica 0 in the caller's scope, replica ``i`` under ``replica_<i>/``).

    Grappler rewrites two graphs that differ only in node names differently (a conv
    kernel's gradient in its last bits); named as the strategy's replicas, every tower's
    kernels are the strategy's (``MobileNetV3Small`` fits bitwise: tests/model/test_equality.py).
    """
    return contextlib.nullcontext() if tower == 0 else tf.name_scope(f"replica_{tower}")


def scoped_tower(op_name: str) -> int | None:
    """The tower ``i > 0`` whose :func:`replica_scope` an op's name carries, else None.

    Example:
        >>> scoped_tower("gradient_tape/replica_2/dense/MatMul"), scoped_tower("dense/MatMul")
        (2, None)
    """
    for part in op_name.split("/")[:-1]:
        match = _REPLICA.match(part)
        if match:
            return int(match.group(1))
    return None
