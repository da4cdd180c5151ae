"""Keep TensorFlow from reordering our additions: run graphs *as written*.

Inside a ``tf.function``, Grappler's arithmetic optimizer rewrites trees of
``Add``/``AddN`` on one device into a single ``AddN`` with its inputs in an order
of its choosing, and constant folding turns ``x / n`` into ``x * (1/n)``. Both
change float results by a few ULPs (measured on TF 2.21: a 6-tower ``add_n``
differed from its eager result by 2 ULPs after Grappler absorbed tower 0's
gradient ``AddN`` into it; a mean was off by one ULP). For a library whose
point is to add in a *stated* order, and to replay that order in NumPy, that is
not acceptable, so towers runs its own compiled steps inside :func:`as_written`.

The switch is TensorFlow's process-wide optimizer setting; :func:`as_written`
sets it around a call and restores it after, so other code keeps Grappler's
defaults. The cost is small: these rewrites save a handful of element-wise ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import tensorflow as tf

__all__ = ["REWRITES", "as_written"]

REWRITES = ("arithmetic_optimization", "constant_folding")
"""The Grappler passes that change the order or form of floating-point arithmetic."""


@contextlib.contextmanager
def as_written() -> Iterator[None]:
    """Run ``tf.function`` calls in the block without the reordering Grappler passes.

    Example:
        >>> with as_written():                  # doctest: +SKIP
        ...     out = my_function(x)
    """
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({name: False for name in REWRITES})
    try:
        yield
    finally:
        # None restores TensorFlow's default for a pass nobody had set.
        tf.config.optimizer.set_experimental_options({name: before.get(name) for name in REWRITES})
