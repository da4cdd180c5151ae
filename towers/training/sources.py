"""Where ``fit``, ``evaluate`` and ``predict`` read their batches: arrays or a tf.data.Dataset.

Arrays are validated once (every part the same length, nothing empty) and sliced per
epoch, reshuffled when asked; a dataset is used as it is batched and must yield
``(x, y)`` or ``(x, y, sample_weight)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, TypeAlias

import numpy as np
import tensorflow as tf

from towers.guard.arguments import positive_int

__all__ = ["Batch", "Source", "batch_length", "inputs", "source", "validation_source"]

Batch: TypeAlias = tuple[Any, Any, Any]


def _length(name: str, value: Any) -> int:
    """The common leading dimension of every array in ``value``."""
    sizes = set()
    for leaf in tf.nest.flatten(value):
        if np.ndim(leaf) == 0:
            raise ValueError(f"{name}: every array needs a batch dimension, got a scalar")
        sizes.add(int(np.shape(leaf)[0]))
    if len(sizes) != 1:
        raise ValueError(f"{name}: its arrays have different lengths {sorted(sizes)}")
    return sizes.pop()


@dataclasses.dataclass(frozen=True)
class Source:
    """One epoch's worth of batches: from arrays (sliced per epoch) or from a dataset."""

    arrays: Batch | None
    dataset: tf.data.Dataset | None
    batch_size: int
    steps: int | None

    def epoch(self, rng: np.random.Generator | None = None) -> Iterator[Batch]:
        """The batches of one epoch; ``rng`` shuffles array data (datasets shuffle themselves)."""
        if self.dataset is not None:
            for element in self.dataset:
                yield _unpack(element)
            return
        assert self.arrays is not None
        x, y, sample_weight = self.arrays
        count = _length("x", x)
        order = rng.permutation(count) if rng is not None else np.arange(count)
        for start in range(0, count, self.batch_size):
            rows = order[start : start + self.batch_size]
            yield _take(x, rows), _take(y, rows), _take(sample_weight, rows)


def _take(arrays: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of every array in a nest (None stays None)."""
    return None if arrays is None else tf.nest.map_structure(lambda a: a[rows], arrays)


def _unpack(element: Any) -> Batch:
    if isinstance(element, tuple) and len(element) in (2, 3):
        x, y, *rest = element
        return x, y, rest[0] if rest else None
    raise ValueError(
        "x: a tf.data.Dataset for fit/evaluate must yield (x, y) or (x, y, sample_weight) "
        f"batches, got {type(element).__name__}"
    )


def source(x: Any, y: Any, sample_weight: Any, batch_size: int, *, need_y: bool) -> Source:
    """Validate inputs and describe their batches.

    Raises:
        ValueError: naming the argument at fault (see :func:`fit`).
    """
    batch_size = positive_int("batch_size", batch_size)
    if isinstance(x, tf.data.Dataset):
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise ValueError(f"{name} must be None when x is a tf.data.Dataset")
        steps = int(x.cardinality())
        return Source(None, x, batch_size, steps if steps >= 0 else None)
    if x is None:
        raise ValueError("x is required: arrays or a tf.data.Dataset")
    if need_y and y is None:
        raise ValueError("y is required when x is an array (or pass a tf.data.Dataset)")
    count = _length("x", x)
    if count == 0:
        raise ValueError("x is empty: it has 0 examples")
    for name, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None and _length(name, value) != count:
            raise ValueError(f"{name} has {_length(name, value)} examples but x has {count}")
    x, y, sample_weight = (
        None if a is None else tf.nest.map_structure(np.asarray, a) for a in (x, y, sample_weight)
    )
    return Source((x, y, sample_weight), None, batch_size, -(-count // batch_size))


def validation_source(validation_data: Any, batch_size: int) -> Source:
    if isinstance(validation_data, tf.data.Dataset):
        return source(validation_data, None, None, batch_size, need_y=True)
    if isinstance(validation_data, tuple | list) and len(validation_data) in (2, 3):
        x, y, sample_weight = (*validation_data, None)[:3]
        return source(x, y, sample_weight, batch_size, need_y=True)
    raise ValueError(
        "validation_data must be (x, y), (x, y, sample_weight) or a tf.data.Dataset, "
        f"got {type(validation_data).__name__}"
    )


def batch_length(x: Any) -> int:
    return int(tf.nest.flatten(x)[0].shape[0])


def inputs(x: Any, batch_size: int) -> tuple[Iterator[Any], int | None]:
    """The input batches ``predict`` reads; a dataset's ``(x, y[, w])`` elements give ``x``."""
    if not isinstance(x, tf.data.Dataset):
        src = source(x, None, None, batch_size, need_y=False)
        return (xb for xb, _, _ in src.epoch()), src.steps
    positive_int("batch_size", batch_size)
    steps = int(x.cardinality())
    elements = (e[0] if isinstance(e, tuple) and len(e) in (1, 2, 3) else e for e in x)
    return elements, steps if steps >= 0 else None
