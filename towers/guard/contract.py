"""The all-reduce contract, checked on what a (user's) algorithm actually returned.

::

    values[tower]  ──algorithm──▶  outputs[tower]      checked when the step is traced:
                                                       len(outputs) == len(values)
                                                       outputs[i]: a tensor, not None
                                                       shape, dtype  == values[i]'s
                                                       device        == values[i]'s

The check reads static properties only (Python, at trace time): it adds no op to the
step's graph, so checked steps are bitwise the unchecked ones. Without it a wrong
device is silently accepted (the optimizer copies the value wherever it is), and a
wrong shape, dtype or a None fails deep inside the optimizer without naming the
algorithm. Every error is an :class:`~towers.guard.errors.AlgorithmError` naming the
algorithm, the tower, the variable, what was expected and what came back.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.devices import canonical_device
from towers.guard.errors import AlgorithmError

__all__ = ["algorithm_name", "check_outputs", "check_rows"]


def algorithm_name(algorithm: Any) -> str:
    """A name to put in an error: the registry name, ``__name__``, or the type's name."""
    while isinstance(algorithm, functools.partial):
        algorithm = algorithm.func
    for attribute in ("name", "__name__"):
        name = getattr(algorithm, attribute, None)
        if isinstance(name, str) and name:
            return name
    return type(algorithm).__name__


def _describe(value: Any) -> str:
    if isinstance(value, tf.IndexedSlices):
        value = value.values
    device = canonical_device(value.device) or "(none)"
    return f"shape {value.shape}, dtype {value.dtype.name}, device {device!r}"


def check_outputs(
    algorithm: Any, values: Sequence[Any], outputs: Any, variable: str = "a value"
) -> list[Any]:
    """``outputs`` as a list when they keep the contract for ``values``; else raise.

    Args:
        algorithm: the algorithm (for its name in the message).
        values: its inputs, one per tower.
        outputs: what it returned.
        variable: which variable's gradient this was (for the message).

    Raises:
        AlgorithmError: not a list of as many tensors as inputs, or output ``i`` with a
            shape, dtype or device other than input ``i``'s.
    """
    name = algorithm_name(algorithm)
    if isinstance(outputs, (tf.Tensor, tf.IndexedSlices)) or not isinstance(outputs, Sequence):
        raise AlgorithmError(name, None, variable, f"a list of {len(values)} tensors",
                             f"{type(outputs).__name__}")  # fmt: skip
    if len(outputs) != len(values):
        raise AlgorithmError(name, None, variable, f"{len(values)} outputs (one per tower)",
                             f"{len(outputs)}")  # fmt: skip
    for tower, (value, out) in enumerate(zip(values, outputs)):
        expected = _describe(value)
        if not isinstance(out, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
            raise AlgorithmError(name, tower, variable, f"a tensor with {expected}",
                                 f"{type(out).__name__}")  # fmt: skip
        want, got = (v.values if isinstance(v, tf.IndexedSlices) else v for v in (value, out))
        same = (
            want.dtype == got.dtype
            and want.shape.is_compatible_with(got.shape)
            and got.shape.rank == want.shape.rank
            and canonical_device(got.device) == canonical_device(want.device)
        )
        if not same:
            raise AlgorithmError(name, tower, variable, expected, _describe(out))
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
