"""A step traced with the batch shape Keras's own ``train_function`` would see.

Keras runs a step inside a ``tf.function`` over its dataset iterator, so the step's
tensors have the iterator's ``element_spec``: an unknown batch dimension whenever the
dataset's batches are not all one size (``fit(x, batch_size=32)`` on 40 examples, or any
``Dataset.batch(b)`` without ``drop_remainder``). ``TowerTrainer.train_step`` is called
with concrete tensors and traces their static size. The two graphs hold the same ops,
but Grappler's constant folding can rewrite a static graph's shape arithmetic in ways
the unknown one keeps, and on some models (ConvNeXt's wide blocks, measured) a few
weights end a few ULPs apart. :class:`RelaxedBatch` closes that gap::

    Keras iterator  element_spec: (None, 32, 32, 3)         batch dim unknown
          │  eager batch of 8 (static shape)
          ▼
    RelaxedBatch(step)(x, y, w)
          ├── once per signature: step.get_concrete_function(TensorSpec((None, ...)))
          └── step(x, y, w)  ─▶ tf.function dispatches to that trace (a supertype)

The batch's split is then cut when the step runs (:func:`towers.split.shard_batch`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from towers.split import batch_size, shard_sizes

__all__ = ["RelaxedBatch", "batch_unknown", "relaxed_spec", "relaxes"]


def batch_unknown(element_spec: Any) -> bool:
    """True when some tensor of ``element_spec`` (a dataset's or iterator's) has a
    leading dimension of unknown size: Keras's step traces that batch dimension unknown."""
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and (shape.rank is None or (shape.rank > 0 and shape[0] is None)):
            return True
    return False


def relaxes(batch_unknown: bool, x: Any, towers: int) -> bool:
    """Whether a step on batch ``x`` over ``towers`` towers takes the relaxed trace: Keras's
    batch dimension is unknown and no tower is left empty. A batch with an empty tower
    (fewer examples than ``(towers - 1) * ceil(B / towers)``) keeps its static trace, in
    which the empty towers do not run the model (Keras 3's Conv2D fails on 0 rows, in
    MirroredStrategy's replicas too)."""
    if not batch_unknown:
        return False
    size = tf.get_static_value(batch_size(x))
    return size is not None and 0 not in shard_sizes(int(size), towers)


def relaxed_spec(inputs: Any) -> Any:
    """``inputs`` (nested; None kept) as type specs: a dense tensor's ``tf.TensorSpec``
    with the leading dimension unknown; any other value's own spec (a ragged or sparse
    tensor keeps its shape)."""

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
    """``step`` (a ``tf.function``, or anything with ``get_concrete_function``) traced with
    the batch dimension unknown, and called with concrete batches of any size.

    ``step`` must be used for nothing else: a static call to it would also dispatch to the
    relaxed trace.
    """

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
