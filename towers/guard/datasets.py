"""A dataset of global batches, checked before the input pipeline is built.

:func:`towers.split.distribute` cuts each element of a ``tf.data.Dataset`` over the
towers; what it needs of the dataset is read from its ``element_spec`` here, so a
mistake is a clear error naming ``dataset`` rather than a failure inside tf.data.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["check_dataset"]


def check_dataset(dataset: Any) -> None:
    """Check that ``dataset`` yields batches ``(x, y[, sample_weight])`` of dense tensors.

    Raises:
        TypeError: not a ``tf.data.Dataset``, or its elements are not ``(x, y[, sample_weight])``.
        ValueError: it looks unbatched (a scalar part, or parts whose leading dimensions differ).
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset of global batches, got "
                        f"{type(dataset).__name__}")  # fmt: skip
    spec = dataset.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3):
        raise TypeError("dataset's elements must be tuples (x, y) or (x, y, sample_weight), got "
                        f"{type(spec).__name__} {spec!r}"[:300])  # fmt: skip
    dims: set[int] = set()
    for leaf in tf.nest.flatten(spec):
        shape = getattr(leaf, "shape", None)
        if not isinstance(leaf, tf.TensorSpec) or shape is None or shape.rank is None:
            raise TypeError(f"dataset's elements must hold dense tensors of known rank, got {leaf}")
        if shape.rank == 0 or (shape[0] is not None and dims and shape[0] not in dims):
            raise ValueError(f"dataset looks unbatched (element spec {spec}): every part needs "
                             "the batch as its first dimension; batch it first: "
                             "dataset.batch(global_batch_size)")  # fmt: skip
        if shape[0] is not None:
            dims.add(shape[0])
