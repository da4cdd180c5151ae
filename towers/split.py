"""Split a batch over towers exactly as ``tf.distribute.MirroredStrategy`` does.

Every tower takes ``c = ceil(B / n)`` examples until the batch runs out (TF 2.21)::

    B = 10, n = 4  ->  [3, 3, 3, 1]
    B =  3, n = 4  ->  [1, 1, 1, 0]      (an empty shard)

so tower ``i`` takes rows ``[min(i*c, B), min((i+1)*c, B))``: the same per-shard arithmetic
as the reference, which makes bitwise comparisons possible. :func:`shard_batch` cuts inside
the step; :func:`distribute` cuts a ``tf.data.Dataset`` in tf.data and prefetches every shard
onto its tower (``experimental_distribute_dataset``)::

    batches ─▶ flat_map: shard_0 … shard_{n-1} ─▶ MultiDeviceIterator: buffers on d_0 … d_{n-1}
                                                   next() ─▶ Shards ─▶ train_step_shards
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops.multi_device_iterator_ops import MultiDeviceIterator

from towers.guard.arguments import check_choice, non_negative_int, positive_int
from towers.guard.given import check_dataset, check_devices

__all__ = ["PIPELINES", "Batch", "DistributedDataset", "Shards", "batch_size", "batch_unknown",
           "check_batch", "concat", "distribute", "relaxes", "shard_batch", "shard_bounds",
           "shard_sizes", "split"]

Batch = tuple[Any, Any, Any]
"""``(x, y, sample_weight)``: ``y`` and ``sample_weight`` may be None."""


def shard_sizes(batch: int, n: int) -> list[int]:
    """Python-side shard sizes for a batch of ``batch`` examples over ``n`` towers."""
    return _sizes(non_negative_int("batch", batch), positive_int("n", n))


def _sizes(batch: int, n: int) -> list[int]:
    per = -(-batch // n)
    return [max(0, min(per, batch - i * per)) for i in range(n)]


def batch_size(structure: Any) -> tf.Tensor:
    """The common leading dimension of every tensor in ``structure`` (an int32 scalar).

    Raises:
        ValueError: a scalar, or static leading dimensions that differ.
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


def batch_unknown(element_spec: Any) -> bool:
    """Whether some tensor of ``element_spec`` has an unknown leading dimension."""
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is not None and (shape.rank is None or (shape.rank > 0 and shape[0] is None)):
            return True
    return False


def relaxes(batch_unknown: bool, x: Any, towers: int) -> bool:
    """Whether a step on ``x`` is traced with the batch dimension unknown
    (:mod:`towers.compile.relaxed`): it is unknown to Keras and no tower is empty (empty
    towers need the static trace, which skips them)."""
    if not batch_unknown:
        return False
    size = tf.get_static_value(batch_size(x))
    return size is not None and 0 not in shard_sizes(int(size), towers)


def shard_bounds(batch: tf.Tensor, n: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    """``(start, stop)`` of each tower's rows, as int32 tensors (works with unknown ``batch``)."""
    per = (batch + (n - 1)) // n
    return [(tf.minimum(i * per, batch), tf.minimum((i + 1) * per, batch)) for i in range(n)]


def split(structure: Any, n: int) -> list[Any]:
    """Split every tensor of a nested structure along axis 0 into ``n`` shards.

    Returns ``n`` structures of the same nesting, shard ``i`` for tower ``i`` (empty when
    the batch has fewer than ``n`` examples).

    Example:
        >>> [int(s.shape[0]) for s in split(tf.zeros([10, 2]), 4)]
        [3, 3, 3, 1]
    """
    positive_int("n", n)
    batch = batch_size(structure)
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [t[start:stop] for t in leaves])
            for start, stop in shard_bounds(batch, n)]


class Shards(NamedTuple):
    """A global batch cut into one ``(x, y, sample_weight)`` piece per tower: a nest of
    tensors (it crosses a ``tf.function`` boundary) whose static shapes tell an empty tower
    at trace time; ``global_batch`` is the whole batch's size (int32)."""

    parts: tuple[Batch, ...]
    global_batch: tf.Tensor

    @property
    def sizes(self) -> list[int | None]:
        """Examples per tower, or None where the size is only known when the step runs."""
        return [tf.TensorShape(tf.nest.flatten(p[0])[0].shape)[0] for p in self.parts]


def _leading_dims(name: str, structure: Any) -> set[int]:
    """Static leading dimensions of every tensor in ``structure`` (unknown ones skipped)."""
    dims: set[int] = set()
    for t in tf.nest.flatten(structure):
        shape = tf.TensorShape(getattr(t, "shape", np.shape(t)))
        if shape.rank == 0:
            raise ValueError(f"{name} has a scalar where a batch was expected")
        if shape.rank is not None and shape[0] is not None:
            dims.add(int(shape[0]))
    return dims


def check_batch(x: Any, y: Any, sample_weight: Any, *, allow_empty: bool = False) -> None:
    """Check that ``x``, ``y`` and ``sample_weight`` share a batch size, non-zero unless
    ``allow_empty`` (a ``ValueError`` when they disagree, a part is a scalar or it is empty)."""
    parts = {"x": x, "y": y, "sample_weight": sample_weight}
    dims = {k: _leading_dims(k, v) for k, v in parts.items() if v is not None}
    all_sizes = set().union(*dims.values())
    if len(all_sizes) > 1:
        detail = ", ".join(f"{k}: {sorted(v)}" for k, v in dims.items())
        raise ValueError(f"x, y and sample_weight must share their batch size; got {detail}")
    if all_sizes == {0} and not allow_empty:
        raise ValueError("the batch is empty: x has 0 examples")


def shard_batch(x: Any, y: Any, sample_weight: Any, n: int) -> Shards:
    """Cut a batch into ``n`` :class:`Shards`: Python slices (static sizes) when the batch
    size is static, else :func:`split` at run time."""
    batch = (x, y, sample_weight)
    present = tuple(part for part in batch if part is not None)
    static = tf.TensorShape(tf.nest.flatten(x)[0].shape)[0]
    if static is None:
        pieces = split(present, n)
    else:
        bounds = np.cumsum([0, *_sizes(int(static), n)])
        pieces = [
            tf.nest.map_structure(lambda t, a=a, b=b: t[a:b], present)
            for a, b in itertools.pairwise(bounds)
        ]
    parts: list[Batch] = []
    for piece in pieces:
        it = iter(piece)
        x_i, y_i, w_i = (None if part is None else next(it) for part in batch)
        parts.append((x_i, y_i, w_i))
    return Shards(tuple(parts), tf.shape(tf.nest.flatten(x)[0], out_type=tf.int32)[0])


def concat(parts: list[Any], device: str) -> Any:
    """Undo a split: concatenate per-tower outputs on ``device``, in tower order."""
    with tf.device(device):
        return tf.nest.map_structure(lambda *t: tf.concat(t, 0), *parts)


PIPELINES = ("multi_device", "per_device")
"""How :func:`distribute` moves shards to the towers: ``multi_device`` reads the source once
and deals the shards with one ``MultiDeviceIterator``; ``per_device`` runs one
``prefetch_to_device`` iterator per tower, each reading the source (which must then yield
the same batches every time: no unseeded shuffle)."""


def _shard_of(element: tuple[Any, ...], tower: tf.Tensor, n: int) -> tuple[Any, ...]:
    """Tower ``tower``'s rows of every tensor in ``element`` (the rule of :func:`split`)."""
    bounds = tf.stack([tf.stack(b) for b in shard_bounds(batch_size(element), n)])
    start, stop = bounds[tower][0], bounds[tower][1]
    return tf.nest.map_structure(lambda t: t[start:stop], element)


@dataclasses.dataclass(frozen=True)
class DistributedDataset:
    """Global batches as :class:`Shards`, ``parts[i]`` on ``devices[i]``; each ``iter()`` is
    one epoch (made by :func:`distribute`)."""

    dataset: tf.data.Dataset
    devices: list[str]
    pipeline: str
    prefetch: int

    def __iter__(self) -> Iterator[Shards]:
        n = len(self.devices)
        if self.pipeline == "multi_device":
            shards = self.dataset.flat_map(
                lambda *e: tf.data.Dataset.range(n).map(lambda i: _shard_of(e, i, n)))
            it = MultiDeviceIterator(shards, self.devices, prefetch_buffer_size=self.prefetch)
            return self._deal(it.get_next)
        iterators = []
        for i, device in enumerate(self.devices):
            mine = self.dataset.map(lambda *e, i=i: _shard_of(e, tf.constant(i, tf.int64), n))
            with tf.device(device):
                iterators.append(iter(mine.apply(
                    tf.data.experimental.prefetch_to_device(device, self.prefetch))))
        return self._deal(lambda: [next(it) for it in iterators])

    def _deal(self, get_next: Any) -> Iterator[Shards]:
        while True:
            try:
                parts = get_next()
            except (StopIteration, tf.errors.OutOfRangeError):
                return
            total = sum(int(tf.nest.flatten(p)[0].shape[0]) for p in parts)
            padded = tuple((*p, None) if len(p) == 2 else tuple(p) for p in parts)
            yield Shards(padded, tf.constant(total, tf.int32))


def distribute(
    dataset: tf.data.Dataset, devices: Sequence[str], *, pipeline: str = "multi_device",
    prefetch: int = 2,
) -> DistributedDataset:
    """The per-device input pipeline: shards of each global batch, prefetched on their towers.

    Args:
        dataset: a batched ``tf.data.Dataset`` of global batches ``(x, y)`` or
            ``(x, y, sample_weight)`` (an uneven last batch is welcome).
        devices: the towers' devices, in tower order (``trainer.devices``).
        pipeline: ``"multi_device"`` or ``"per_device"`` (:data:`PIPELINES`).
        prefetch: shards buffered on each device ahead of the step.

    Returns:
        A :class:`DistributedDataset` of one :class:`Shards` per global batch, for
        :meth:`towers.TowerTrainer.train_step_shards`.

    Raises:
        TypeError: ``dataset`` is not a Dataset of tensors; ``devices`` not device names.
        ValueError: an unbatched ``dataset``, empty or unknown ``devices``, a bad
            ``pipeline`` or ``prefetch``.

    Example:
        >>> data = tf.data.Dataset.from_tensor_slices((x, y)).batch(256)  # doctest: +SKIP
        >>> for shards in distribute(data, trainer.devices):               # doctest: +SKIP
        ...     loss = trainer.train_step_shards(shards)
    """
    devices = check_devices(devices)
    check_choice("pipeline", pipeline, PIPELINES)
    prefetch = positive_int("prefetch", prefetch)
    check_dataset(dataset)
    return DistributedDataset(dataset, devices, pipeline, prefetch)
