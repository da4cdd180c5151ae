"""Keras's unknown batch dimension: a step traced once for batches of any size.

Keras runs a step inside a tf.function over its dataset iterator, so the step's tensors have
the iterator's element_spec: an unknown batch dimension whenever the batches are not all one
size. Grappler's constant folding can rewrite a static graph's shape arithmetic in ways the
unknown one keeps (ConvNeXt's wide blocks: a few ULPs), so ``TowerModel.fit``'s step is traced
with the batch dimension unknown (:class:`RelaxedBatch`), then called with concrete batches.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["RelaxedBatch", "relaxed_spec"]


def relaxed_spec(inputs: Any) -> Any:
    """``inputs`` (nested; None kept) as type specs: a dense tensor's ``tf.TensorSpec``
    with the leading dimension unknown; any other value's own spec."""

    def spec(t: Any) -> Any:
        if t is None:
            return None
        if not isinstance(t, tf.Tensor):
            return tf.type_spec_from_value(t)
        shape = tf.TensorShape(t.shape)
        if shape.rank:
            shape = tf.TensorShape([None]).concatenate(shape[1:])
        return tf.TensorSpec(shape, t.dtype)

    return tf.nest.map_structure(spec, inputs, expand_composites=False)


class RelaxedBatch:
    """``step`` (anything with ``get_concrete_function``) traced with the batch dimension
    unknown, once per signature, and called with concrete batches of any size (a supertype
    trace serves them). ``step`` must be used for nothing else."""

    def __init__(self, step: Any) -> None:
        self.step = step
        self._traced: set[Any] = set()

    def _trace(self, inputs: tuple[Any, ...]) -> None:
        specs = relaxed_spec(inputs)
        key = tuple(tf.nest.flatten(specs)), str(tf.nest.map_structure(lambda _: 0, specs))
        if key not in self._traced:
            self.step.get_concrete_function(*specs)
            self._traced.add(key)

    def __call__(self, *inputs: Any) -> Any:
        self._trace(inputs)
        return self.step(*inputs)

    def get_concrete_function(self, *inputs: Any) -> Any:
        """The relaxed trace serving ``inputs``."""
        self._trace(inputs)
        return self.step.get_concrete_function(*inputs)

