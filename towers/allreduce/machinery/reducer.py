"""Lift any all-reduce to a :class:`~towers.allreduce.machinery.base.GradientReducer` of a step.

The step reduces ``grads[tower][var]``: every trainable variable's gradient on every
tower. Two kinds of algorithm can do it::

    per-tensor AllReduce  ──▶  one call per variable, in variable order
    GradientReducer       ──▶  one call for every dense gradient at once
                               (buckets, compression with per-variable state)

and sparse gradients (``tf.IndexedSlices``, an Embedding's) are kept sparse —
their indices and values gathered in tower order, as MirroredStrategy does — or
densified and all-reduced with the per-tensor algorithm (``sparse="densify"``).
:func:`as_reducer` folds these cases into one object, so the step calls
``reducer.reduce_gradients(grads)`` and nothing else.

What an algorithm returns is checked against the contract when the step is traced
(:func:`check_outputs`: as many outputs as inputs, output ``i`` with input ``i``'s shape,
dtype and device; static properties only, no op): an ``AlgorithmError`` naming the
algorithm, tower and variable, not a wrong device accepted silently.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import (
    AllReduce,
    GradientReducer,
    StatefulReducer,
    check_values,
)
from towers.allreduce.machinery.registry import Configured, algorithm_name
from towers.allreduce.machinery.sparse import densified, densify, gather_indexed_slices
from towers.allreduce.naive import naive
from towers.devices import canonical_device
from towers.guard.arguments import check_choice
from towers.guard.errors import AlgorithmError

__all__ = ["SPARSE", "StepReducer", "as_reducer", "check_outputs", "check_rows"]

# id(reducer) -> (the reducer, the first variable it was built for), both weakly held
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}

SPARSE = ("gather", "densify")
"""What to do with sparse gradients: keep them sparse (gather), or densify and all-reduce."""


def _reduce_one(values: list[tf.Tensor | tf.IndexedSlices], fn: AllReduce, sparse: str,
                variable: str) -> list:  # fmt: skip
    """One variable's gradients, one per tower, through ``fn`` (sparse ones as ``sparse``
    says), checked against the contract (:func:`check_outputs`)."""
    run = fn.run if isinstance(fn, Configured) else fn  # its function, called directly
    if isinstance(values[0], tf.IndexedSlices):
        devices = check_values(values, "sum")
        if sparse == "densify":
            return list(densify(run, values, devices, "sum"))
        return list(gather_indexed_slices(values, devices, "sum"))
    return check_outputs(fn, values, run(list(values), op="sum"), variable)


class StepReducer:
    """A :class:`GradientReducer` for a whole step, made by :func:`as_reducer`.

    Dense gradients go to ``dense`` all at once when it is set; every other gradient
    goes to ``per_tensor`` one variable at a time, in variable order.

    Attributes:
        dense: the wrapped ``GradientReducer``, or None for a per-tensor algorithm.
        per_tensor: the per-tensor algorithm (``naive`` beside a ``GradientReducer``).
        sparse: ``"gather"`` or ``"densify"``.
        pending: the new state of a ``StatefulReducer`` that the last
            :meth:`reduce_gradients` computed in the graph being traced (else empty).
    """

    def __init__(
        self, dense: GradientReducer | None, per_tensor: AllReduce, sparse: str = "gather"
    ) -> None:
        check_choice("sparse", sparse, SPARSE)
        self.dense, self.per_tensor, self.sparse = dense, per_tensor, sparse
        self.names: list[str] = []
        self.pending: list[tf.Tensor] = []

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Build the wrapped ``GradientReducer`` (once, eagerly, before the first step);
        keep the variables' names for the contract's errors.

        Raises:
            ValueError: the ``GradientReducer`` was built for another model's variables
                (:func:`claim`).
        """
        self.names = [getattr(v, "path", None) or v.name for v in variables]
        if self.dense is not None:
            claim(self.dense, variables)
            self.dense.build(variables, devices)

    def reduce_gradients(
        self, grads: Sequence[Sequence[tf.Tensor | tf.IndexedSlices]]
    ) -> list[list[tf.Tensor | tf.IndexedSlices]]:
        """``grads[tower][var]`` -> ``reduced[tower][var]``, each the sum over towers.

        A :class:`~towers.allreduce.machinery.base.StatefulReducer`'s new state is *not* assigned:
        :attr:`pending` holds it for the step, which passes it to :meth:`commit`.

        Raises:
            AlgorithmError: the algorithm's outputs break the contract (count; per tower
                shape, dtype, device), naming the algorithm, the tower and the variable.
        """
        self.pending = []  # nothing left from an earlier trace
        if self.dense is not None and self.sparse == "densify":
            grads = densified(grads)  # through the reducer, like every other gradient
        n_vars = len(grads[0])
        names = (
            self.names if len(self.names) == n_vars else [f"gradient {j}" for j in range(n_vars)]
        )
        out: list[list[tf.Tensor | tf.IndexedSlices | None]] = [[None] * n_vars for _ in grads]
        dense = [j for j in range(n_vars) if not isinstance(grads[0][j], tf.IndexedSlices)]
        if self.dense is not None and dense:
            inputs = [[g[j] for j in dense] for g in grads]
            rows = check_rows(self.dense, inputs, self._dense_rows(self.dense, inputs),
                              [names[j] for j in dense])  # fmt: skip
            for i, row in enumerate(rows):
                for j, value in zip(dense, row):
                    out[i][j] = value
        for j in range(n_vars):
            if out[0][j] is None:
                values = _reduce_one([g[j] for g in grads], self.per_tensor, self.sparse, names[j])
                for i, value in enumerate(values):
                    out[i][j] = value
        return out  # type: ignore[return-value]  # every slot is filled


    def _dense_rows(self, dense: GradientReducer, inputs: list[list[Any]]) -> list[list[Any]]:
        if isinstance(dense, StatefulReducer):
            rows, self.pending = dense.reduce_deferred(inputs)
            return rows
        return dense.reduce_gradients(inputs)

    def commit(self, new_state: Sequence[tf.Tensor], applied: tf.Tensor | None) -> None:
        """Assign ``new_state`` (:attr:`pending`; empty: nothing) when the boolean
        ``applied`` holds (a ``LossScaleOptimizer``'s "gradients finite"; None: the caller
        is inside the guard's cond, it does)."""
        if not new_state or not isinstance(self.dense, StatefulReducer):
            return
        dense = self.dense

        def assign() -> tf.Tensor:
            dense.commit(new_state)
            return tf.constant(True)

        if applied is None:
            assign()
        else:
            tf.cond(applied, assign, lambda: tf.constant(False))


def claim(reducer: GradientReducer, variables: Sequence[tf.Variable]) -> None:
    """Let ``reducer`` serve ``variables`` only: a ``GradientReducer`` object keeps state
    per trainer (error feedback, a bucket layout, the towers' devices), so one handed to
    two trainers would mix theirs. Building it again for the same variables (a model
    compiled again) is allowed; for others, while the first ones live, it is refused.

    Raises:
        ValueError: ``reducer`` already serves another trainer's variables.
    """
    if not variables:
        return
    for key, (ref, _) in list(_OWNERS.items()):
        if ref() is None:
            del _OWNERS[key]
    ref_var = _OWNERS.get(id(reducer), (None, lambda: None))[1]
    owner = ref_var()
    if owner is not None and owner is not variables[0]:
        raise ValueError(
            f"all_reduce: {type(reducer).__name__} object {reducer!r:.60} already serves "
            "another trainer; it keeps state per trainer (error feedback, buckets, devices), "
            "so sharing it would mix theirs. Make a new one for each trainer, or pass its "
            "name string instead, which makes one per trainer."
        )
    _OWNERS[id(reducer)] = (weakref.ref(reducer), weakref.ref(variables[0]))


def as_reducer(algorithm: AllReduce | GradientReducer, *, sparse: str = "gather") -> StepReducer:
    """The step's reducer for ``algorithm``: a per-tensor ``AllReduce`` or a ``GradientReducer``.

    Args:
        algorithm: a resolved algorithm (a callable, not a registry name).
        sparse: ``"gather"`` (keep ``IndexedSlices``, concatenated in tower order) or
            ``"densify"`` (make them dense on their towers and all-reduce them with
            ``algorithm``, a ``GradientReducer`` included).

    Raises:
        ValueError: an unknown ``sparse`` mode.

    Example:
        >>> reducer = as_reducer(ring())                         # doctest: +SKIP
        >>> reduced = reducer.reduce_gradients(grads)            # reduced[tower][var]
    """
    if isinstance(algorithm, GradientReducer):
        return StepReducer(algorithm, naive, sparse)
    return StepReducer(None, algorithm, sparse)


def _describe(value: Any) -> str:
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    device = canonical_device(value.device) or "(none)"
    return f"shape {value.shape}, dtype {value.dtype.name}, device {device!r}"


def check_outputs(
    algorithm: Any, values: Sequence[Any], outputs: Any, variable: str = "a value"
) -> list[Any]:
    """``outputs`` (what ``algorithm`` returned for ``values``, one per tower, the
    gradients of ``variable``) as a list when they keep the contract; else raise.

    Raises:
        AlgorithmError: not a list of as many tensors as inputs, or output ``i`` with a
            shape, dtype or device other than input ``i``'s.
    """
    if isinstance(outputs, (tf.Tensor, tf.IndexedSlices)) or not isinstance(outputs, Sequence):
        raise AlgorithmError(algorithm_name(algorithm), None, variable,
                             f"a list of {len(values)} tensors", f"{type(outputs).__name__}")
    if len(outputs) != len(values):
        raise AlgorithmError(algorithm_name(algorithm), None, variable,
                             f"{len(values)} outputs (one per tower)", f"{len(outputs)}")
    for tower, (value, out) in enumerate(zip(values, outputs)):
        if not isinstance(out, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
            raise AlgorithmError(algorithm_name(algorithm), tower, variable,
                                 f"a tensor with {_describe(value)}", f"{type(out).__name__}")
        want, got = (v.values if isinstance(v, tf.IndexedSlices) else v for v in (value, out))
        same = (
            want.dtype == got.dtype
            and want.shape.is_compatible_with(got.shape)
            and got.shape.rank == want.shape.rank
            and canonical_device(got.device) == canonical_device(want.device)
        )
        if not same:
            raise AlgorithmError(algorithm_name(algorithm), tower, variable, _describe(value),
                                 _describe(out))
    return list(outputs)


def check_rows(
    algorithm: Any, grads: Sequence[Sequence[Any]], rows: Any, variables: Sequence[str]
) -> list[list[Any]]:
    """The contract for a ``GradientReducer``: ``rows[tower][var]`` like ``grads``.

    Raises:
        AlgorithmError: a wrong number of rows (towers) or of gradients in a row, or
            an output that :func:`check_outputs` refuses.
    """
    name = algorithm_name(algorithm)
    if not isinstance(rows, Sequence) or len(rows) != len(grads):
        got = len(rows) if isinstance(rows, Sequence) else type(rows).__name__
        raise AlgorithmError(name, None, "every variable", f"{len(grads)} rows (one per tower)",
                             str(got))  # fmt: skip
    for tower, row in enumerate(rows):
        if not isinstance(row, Sequence) or len(row) != len(grads[tower]):
            got = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise AlgorithmError(name, tower, "every variable",
                                 f"{len(grads[tower])} gradients", str(got))  # fmt: skip
    for j, variable in enumerate(variables):
        check_outputs(algorithm, [g[j] for g in grads], [row[j] for row in rows], variable)
    return [list(row) for row in rows]
