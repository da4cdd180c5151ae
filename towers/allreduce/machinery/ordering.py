"""Keep TensorFlow from reordering our additions: run graphs *as written*.

Inside a ``tf.function``, Grappler's arithmetic optimizer rewrites trees of
``Add``/``AddN`` on one device into a single ``AddN`` with its inputs in an order
of its choosing, and constant folding turns ``x / n`` into ``x * (1/n)``. Both
change float results by a few ULPs (measured on TF 2.21: a 6-tower ``add_n``
differed from its eager result by 2 ULPs after Grappler absorbed tower 0's
gradient ``AddN`` into it; a mean was off by one ULP). For a library whose
point is to add in a *stated* order, and to replay that order in NumPy, that is
not acceptable, so towers runs its reduction and update inside :func:`as_written`
— and only those by default: the towers' forward/backward compile under the caller's
settings, as tf.distribute's replicas do (:mod:`towers.compile.step`). The names
of the towers' ops matter to Grappler too (:func:`replica_scope`).

The switch is TensorFlow's process-wide optimizer setting; :func:`as_written`
sets it around a call and restores it after, so other code keeps Grappler's
defaults. The cost is small: these rewrites save a handful of element-wise ops.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["REWRITES", "as_written", "callers_rewrites", "replica_scope", "scoped_tower"]

REWRITES = ("arithmetic_optimization", "constant_folding")
"""The Grappler passes that change the order or form of floating-point arithmetic."""

_CALLERS: list[dict[str, Any]] = []
"""The settings each open :func:`as_written` block replaced, innermost last."""


@contextlib.contextmanager
def as_written() -> Iterator[None]:
    """Run ``tf.function`` calls in the block without the reordering Grappler passes.

    Example:
        >>> with as_written():                  # doctest: +SKIP
        ...     out = my_function(x)
    """
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({name: False for name in REWRITES})
    _CALLERS.append(before)
    try:
        yield
    finally:
        _CALLERS.pop()
        # None restores TensorFlow's default for a pass nobody had set.
        tf.config.optimizer.set_experimental_options({name: before.get(name) for name in REWRITES})


def callers_rewrites() -> dict[str, Any]:
    """The :data:`REWRITES` settings outside the innermost :func:`as_written` block (the
    caller's, while towers traces its update), else the current ones; None: the default."""
    source = _CALLERS[-1] if _CALLERS else tf.config.optimizer.get_experimental_options()
    return {name: source.get(name) for name in REWRITES}


_REPLICA = re.compile(r"replica_(\d+)$")


def replica_scope(tower: int) -> Any:
    """The name scope of tower ``tower``'s ops: the names ``MirroredStrategy`` gives its
    replicas (replica 0 in the caller's scope, replica ``i`` under ``replica_<i>/``).

    Names are not cosmetic. Grappler's arithmetic optimizer and constant folding rewrite
    two graphs that differ only in their node names differently (measured on TF 2.21:
    Conv2D → ``hard_swish`` → pooling → Dense, one device, the same tape step with and
    without a name scope around it: the conv kernel's gradient differs in its last bits).
    Named like the strategy's replicas, every tower's kernels are the strategy's:
    ``keras.applications.MobileNetV3Small`` fits bitwise as under ``MirroredStrategy``
    (tests/model/test_equality.py; its hard_swish block: test_ordering.py); under
    ``tower_<i>`` scopes its conv kernels differed in their last bits after one step.
    Tower 0's ops therefore carry no scope of their own (:func:`scoped_tower`).
    """
    return contextlib.nullcontext() if tower == 0 else tf.name_scope(f"replica_{tower}")


def scoped_tower(op_name: str) -> int | None:
    """The tower ``i > 0`` whose :func:`replica_scope` an op's name carries, else None
    (tower 0's ops, like any op outside a tower, carry none).

    Example:
        >>> scoped_tower("gradient_tape/replica_2/dense/MatMul"), scoped_tower("dense/MatMul")
        (2, None)
    """
    for part in op_name.split("/")[:-1]:
        match = _REPLICA.match(part)
        if match:
            return int(match.group(1))
    return None
