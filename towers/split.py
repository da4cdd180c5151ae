"""Split a batch over towers exactly as ``tf.distribute.MirroredStrategy`` does.

MirroredStrategy gives every replica ``ceil(B / n)`` examples until the batch
runs out (measured on TF 2.21)::

    B = 10, n = 4  ->  [3, 3, 3, 1]
    B =  3, n = 4  ->  [1, 1, 1, 0]      (an empty shard)
    B =  9, n = 4  ->  [3, 3, 3, 0]

so tower ``i`` takes rows ``[min(i*c, B), min((i+1)*c, B))`` with ``c = ceil(B/n)``.
Splitting the same way keeps towers' per-shard arithmetic identical to the
reference's, which is what makes bitwise comparisons possible.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["batch_size", "shard_bounds", "shard_sizes", "split"]


def shard_sizes(batch: int, n: int) -> list[int]:
    """Python-side shard sizes for a batch of ``batch`` examples over ``n`` towers."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if batch < 0:
        raise ValueError(f"batch must be non-negative, got {batch}")
    per = -(-batch // n)
    return [max(0, min(per, batch - i * per)) for i in range(n)]


def batch_size(structure: Any) -> tf.Tensor:
    """The common leading dimension of every tensor in ``structure`` (an int32 scalar).

    Raises:
        ValueError: the tensors' leading dimensions differ (checked statically when
            known), or a tensor is a scalar.
    """
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    if not leaves:
        raise ValueError("the batch is empty: expected at least one tensor")
    static = {}
    for i, t in enumerate(leaves):
        if t.shape.rank == 0:
            raise ValueError(f"batch element {i} is a scalar: every input needs a batch dimension")
        if t.shape.rank is not None and t.shape[0] is not None:
            static[i] = int(t.shape[0])
    if len(set(static.values())) > 1:
        raise ValueError(
            "inputs must share their leading (batch) dimension, got sizes "
            + ", ".join(f"element {i}: {b}" for i, b in static.items())
        )
    return tf.shape(leaves[0], out_type=tf.int32)[0]


def shard_bounds(batch: tf.Tensor, n: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """``(start, stop)`` of each tower's rows, as int32 tensors (works with unknown ``batch``)."""
    per = (batch + (n - 1)) // n
    return [(tf.minimum(i * per, batch), tf.minimum((i + 1) * per, batch)) for i in range(n)]


def split(structure: Any, n: int) -> list[Any]:
    """Split every tensor of a nested structure along axis 0 into ``n`` shards.

    Args:
        structure: a tensor, or a tuple/list/dict nest of tensors sharing their
            leading dimension.
        n: number of towers.

    Returns:
        ``n`` structures of the same nesting; shard ``i`` goes to tower ``i``.
        Shards may be empty when the batch has fewer than ``n`` examples.

    Example:
        >>> [int(s.shape[0]) for s in split(tf.zeros([10, 2]), 4)]
        [3, 3, 3, 1]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    batch = batch_size(structure)
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    shards = []
    for start, stop in shard_bounds(batch, n):
        parts = [t[start:stop] for t in leaves]
        shards.append(tf.nest.pack_sequence_as(structure, parts))
    return shards
