"""Keep TensorFlow from reordering our additions: run graphs *as written*.

Inside a ``tf.function``, Grappler's arithmetic optimizer regroups trees of ``Add``/``AddN``
on one device into one ``AddN`` with its inputs in an order of its choosing, and constant
folding turns ``x / n`` into ``x * (1/n)``: a few ULPs each. A library that adds in a
*stated* order, and replays that order in NumPy, cannot allow that, so towers runs its
reduction and update inside :func:`as_written`, and only those by default
(:mod:`towers.compile.step`). The names of the towers' ops matter too (:func:`replica_scope`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["REWRITES", "as_written", "callers_rewrites", "replica_scope", "rewrites",
           "scoped_tower"]

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
