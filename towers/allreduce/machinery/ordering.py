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
settings, as tf.distribute's replicas do (:data:`FORWARD_GRAPHS`, :class:`PhasedStep`).

The switch is TensorFlow's process-wide optimizer setting; :func:`as_written`
sets it around a call and restores it after, so other code keeps Grappler's
defaults. The cost is small: these rewrites save a handful of element-wise ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["FORWARD_GRAPHS", "REWRITES", "PhasedStep", "as_written"]

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


FORWARD_GRAPHS = ("default", "as_written")
"""How a trainer compiles its step (``TowerTrainer(forward_graph=...)``):

``"default"``: two ``tf.function`` calls per step, :class:`PhasedStep`. The towers'
forward/backward (and the split) compile under the caller's Grappler settings —
TensorFlow's defaults unless changed, the settings tf.distribute's replica step
compiles under — and only the reduction and the update under :func:`as_written`.
The towers' gradients are then bitwise those of ``MirroredStrategy``'s replicas on
real Keras models (BatchNorm after linear convolutions, depthwise convolutions,
attention with LayerNorm: measured, docs/bounds.md), and the reduction keeps its
stated order. Cost: one more function call per step, whose Python dispatch of the
towers' results dominates: measured +0.7 ms (dense, 1.36 vs 0.68 ms), +1.2 ms (conv +
BatchNorm, 3.18 vs 1.99 ms) and +1.15 ms (attention, 3.26 vs 2.11 ms) per step at 2
CPU towers, medians of 100 interleaved rounds on a shared 2-core machine; a fixed cost
per step, small beside a real model's step.

``"as_written"``: the whole step in one ``tf.function`` under :func:`as_written`.
One call and one graph, but Grappler's passes are off for the towers' kernels too,
so a tower's gradient equals an *eager* computation's, not a default
``tf.function``'s: several hundred ULPs from MirroredStrategy's where a gradient
cancels (a convolution's bias before BatchNorm), and Adam turns those into
full-size steps. Use it to compare with a reference that is itself run
``as_written()``, or where one graph per step matters.
"""


class PhasedStep:
    """A step compiled as two functions: ``forward`` as the caller's settings compile it,
    then ``update`` under :func:`as_written` (``forward_graph="default"``).

    Args:
        forward: a ``tf.function``: ``(x, y, sample_weight) -> (grads, outputs)``.
        update: a ``tf.function``: ``grads -> loss``, the reduction and the update.
        with_outputs: return ``(loss, outputs)`` instead of the loss.
    """

    def __init__(self, forward: Any, update: Any, with_outputs: bool = False) -> None:
        self.forward, self.update, self.with_outputs = forward, update, with_outputs
        self._updates: dict[Any, Any] = {}  # the forward's concrete function -> the update's

    def __call__(self, *inputs: Any) -> Any:
        # The update's concrete function is the forward's partner, found once: calling
        # it directly skips tf.function's matching of every tower's gradients against
        # its signatures (measured 1.9 -> 1.2 ms per step on conv-MNIST, 4 towers).
        update = self._updates[self.get_concrete_function(*inputs)]
        grads, outputs = self.forward(*inputs)
        with as_written():
            loss = update(grads)
        return (loss, outputs) if self.with_outputs else loss

    def get_concrete_function(self, *inputs: Any) -> Any:
        """Trace (or find) both functions for these inputs; returns the forward's."""
        forward = self.forward.get_concrete_function(*inputs)
        if forward not in self._updates:
            with as_written():
                self._updates[forward] = self.update.get_concrete_function(
                    forward.structured_outputs[0])
        return forward
