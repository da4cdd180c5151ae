"""Bucketed all-reduce: pack many gradients into a few flat buffers, reduce each buffer once.

As PyTorch DDP and TensorFlow's CollectiveAllReduce: buckets of up to
``bytes_per_bucket`` (DDP: 25 MiB) in **reverse** variable order (backward produces the
last layer's first), one dtype each, a tensor never split. ``B`` = bucket size::

    model order           w0   b0   w1   b1   w2   b2        (w1 alone is > B bytes)
    reverse order         b2   w2   b1 │ w1 │ b0   w0
    bucket 0  [ b2 | w2 | b1 ]   ≤ B bytes                 all-reduced first
    bucket 1  [ w1 ]             > B: alone                 then this one
    bucket 2  [ b0 | w0 ]        ≤ B bytes                  last

    per tower t:   g[t][0..5] ─pack─▶ bucket_k[t] ─algorithm(bucket_k[0..n-1])─▶
                   reduced_k[t] ─unpack─▶ out[t][0..5]   (original shapes and order)

Cost (K buckets, ring): ``2(n-1)·K·α + …`` instead of ``2(n-1)·V·α + …`` for V variables.

References:
    S. Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
    Training", VLDB 2020 (gradient bucketing, reverse order). TensorFlow
    ``cross_device_utils.group_by_size`` (``bytes_per_pack``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, device_of
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.resolve import get
from towers.allreduce.machinery.sparse import gather_indexed_slices
from towers.devices import canonical_device
from towers.guard.arguments import optional, positive_int

__all__ = ["BucketLayout", "Bucketed", "Layout", "Slot", "bucketed", "grouped", "pack", "plan",
           "unpack"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one tensor sits in its bucket: original ``index``, ``shape``, ``offset``, ``size``."""

    index: int
    shape: tuple[int, ...]
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """One bucket: its dtype and its slots in packing order (``size``: its length in elements)."""

    dtype: tf.DType
    slots: tuple[Slot, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.slots)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.size


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every bucket of one tower's tensors, in all-reduce order, and the tensor count."""

    buckets: tuple[BucketLayout, ...]
    count: int


def plan(
    specs: Sequence[tuple[Sequence[int], Any]], bytes_per_bucket: int | None = DEFAULT_BUCKET_BYTES
) -> Layout:
    """Assign tensors (``(shape, dtype)`` in variable order) to buckets, in reverse order:
    one open bucket per dtype, closed before a tensor that would overflow it and after one
    that fills it; buckets listed in the order they were opened."""
    limit = optional(positive_int, "bytes_per_bucket", bytes_per_bucket)
    closed: list[tuple[int, BucketLayout]] = []  # (opening rank, bucket)
    open_: dict[tf.DType, tuple[int, list[Slot]]] = {}
    opened = 0
    for index in reversed(range(len(specs))):
        shape, dtype = tf.TensorShape(specs[index][0]), tf.as_dtype(specs[index][1])
        if not shape.is_fully_defined():
            raise ValueError(f"tensor {index} has shape {shape}: bucketing needs static shapes")
        size = int(shape.num_elements())
        rank, slots = open_.get(dtype, (opened, []))
        used = sum(s.size for s in slots) * dtype.size
        if slots and limit is not None and used + size * dtype.size > limit:
            closed.append((rank, BucketLayout(dtype, tuple(slots))))
            rank, slots, used = opened, [], 0
        if not slots:
            opened += 1
        slots.append(Slot(index, tuple(int(d) for d in shape), used // dtype.size, size))
        open_[dtype] = (rank, slots)
        if limit is not None and used + size * dtype.size >= limit:
            closed.append((rank, BucketLayout(dtype, tuple(slots))))
            del open_[dtype]
    closed += [(rank, BucketLayout(dtype, tuple(slots))) for dtype, (rank, slots) in open_.items()]
    return Layout(tuple(b for _, b in sorted(closed, key=lambda rb: rb[0])), len(specs))


def pack(
    tensors: Sequence[tf.Tensor], bytes_per_bucket: int | None = DEFAULT_BUCKET_BYTES
) -> tuple[list[tf.Tensor], Layout]:
    """``(buckets, layout)``: one tower's ``tensors`` flattened into :func:`plan`'s 1-D
    buckets, each on its first tensor's device (``unpack(*pack(x))`` is ``x`` bitwise)."""
    layout = plan([(t.shape, t.dtype) for t in tensors], bytes_per_bucket)
    buckets = []
    for bucket in layout.buckets:
        parts = [tensors[s.index] for s in bucket.slots]
        with tf.device(parts[0].device):  # "" (no device): the caller's scope
            flat = [tf.reshape(p, [s.size]) for p, s in zip(parts, bucket.slots)]
            buckets.append(tf.concat(flat, 0) if len(flat) > 1 else flat[0])
    return buckets, layout


def unpack(buckets: Sequence[tf.Tensor], layout: Layout) -> list[tf.Tensor]:
    """Undo :func:`pack`: ``layout.count`` tensors in their original order and shapes."""
    if len(buckets) != len(layout.buckets):
        raise ValueError(f"got {len(buckets)} buckets, the layout has {len(layout.buckets)}")
    out: list[tf.Tensor] = [None] * layout.count
    for k, (flat, bucket) in enumerate(zip(buckets, layout.buckets)):
        if flat.shape != tf.TensorShape([bucket.size]) or flat.dtype != bucket.dtype:
            raise ValueError(
                f"buckets[{k}] is {flat.dtype.name} {flat.shape}, expected "
                f"{bucket.dtype.name} ({bucket.size},)"
            )
        with tf.device(flat.device):
            sizes = [s.size for s in bucket.slots]
            parts = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
            for part, s in zip(parts, bucket.slots):
                out[s.index] = tf.reshape(part, s.shape)
    return out


@dataclasses.dataclass
class Bucketed:
    """A ``GradientReducer`` over packed buckets (``layout``: :meth:`build`'s variables')."""

    algorithm: AllReduce
    bytes_per_bucket: int | None
    devices: list[str] | None = None
    layout: Layout | None = None

    def build(self, variables: Sequence[tf.Variable], devices: Sequence[str]) -> None:
        """Record the towers' devices and plan the buckets of ``variables``' gradients."""
        self.devices = [canonical_device(d) for d in devices]
        self.layout = plan([(v.shape, v.dtype) for v in variables], self.bytes_per_bucket)

    def reduce_gradients(self, grads: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """Pack each tower's ``grads[tower]``, all-reduce bucket by bucket, unpack."""
        return grouped(grads, self.algorithm, "sum", bytes_per_bucket=self.bytes_per_bucket,
                       devices=self.devices)


def grouped(values: Sequence[Sequence[tf.Tensor | tf.IndexedSlices]],
            algorithm: str | AllReduce = "ring", op: str = "sum", *,
            bytes_per_bucket: int | None = DEFAULT_BUCKET_BYTES,
            devices: Sequence[str] | None = None) -> list[list[tf.Tensor | tf.IndexedSlices]]:
    """All-reduce ``values[tower][k]`` (same layout out): dense tensors in buckets
    (:func:`pack`), ``tf.IndexedSlices`` gathered in tower order (sum or mean)."""
    fn = get(algorithm)
    if not values or isinstance(values[0], (tf.Tensor, tf.IndexedSlices)):
        raise ValueError("values must be a non-empty list, per tower, of lists of tensors")
    devices = list(devices or [device_of(v[0], f"values[{t}]") for t, v in enumerate(values)])
    if len(values) != len(devices):
        raise ValueError(f"got values of {len(values)} towers for {len(devices)} devices")
    sparse = [isinstance(x, tf.IndexedSlices) for x in values[0]]
    for t, row in enumerate(values):
        if [isinstance(x, tf.IndexedSlices) for x in row] != sparse:
            raise ValueError(f"tower {t}'s values differ from tower 0's in count or kind "
                             "(dense or IndexedSlices)")
    out: list[list[Any]] = [[None] * len(sparse) for _ in devices]
    for k in (k for k, s in enumerate(sparse) if s):
        if op not in ("sum", "mean"):
            raise ValueError(f"values[0][{k}] is an IndexedSlices: op must be 'sum' or 'mean' "
                             f"(rows are gathered), got {op!r}")
        for t, x in enumerate(gather_indexed_slices([v[k] for v in values], devices, op)):
            out[t][k] = x
    dense = [k for k, s in enumerate(sparse) if not s]
    for t, reduced in enumerate(_reduce_dense([[v[k] for k in dense] for v in values],
                                              devices, fn, op, bytes_per_bucket)):
        for k, x in zip(dense, reduced):
            out[t][k] = x
    return out


def _reduce_dense(values: list[list[tf.Tensor]], devices: list[str], fn: AllReduce, op: str,
                  bytes_per_bucket: int | None) -> list[list[tf.Tensor]]:
    """Pack each tower's dense ``values[tower]``, all-reduce bucket by bucket, unpack."""
    if not values[0]:
        return [[] for _ in devices]
    packed = per_tower(devices, lambda tower: pack(values[tower], bytes_per_bucket))
    layout = packed[0][1]
    for tower, (_, other) in enumerate(packed):
        if other != layout:
            raise ValueError(f"tower {tower}'s values differ from tower 0's in shape/dtype")
    reduced: list[list[tf.Tensor]] = [[] for _ in devices]
    for k in range(len(layout.buckets)):
        for tower, out in enumerate(fn([buckets[k] for buckets, _ in packed], op=op)):
            reduced[tower].append(out)
    return per_tower(devices, lambda tower: unpack(reduced[tower], layout))


def bucketed(
    algorithm: str | AllReduce = "ring", bytes_per_bucket: int | None = DEFAULT_BUCKET_BYTES
) -> Bucketed:
    """Reduce all of a step's gradients in flat buckets of at most ``bytes_per_bucket``
    (``None``: one bucket per dtype), ``algorithm`` (a name or a callable) once per bucket."""
    return Bucketed(get(algorithm), optional(positive_int, "bytes_per_bucket", bytes_per_bucket))
