"""Packed slots: a slot is a row of a 2-D tensor, so one tick's chunks between two towers
travel as one tensor and are combined by one op::

    tower's buffer  [chunks, L]   rows = chunks (pad_rows: zero padding at the end)
         │ tick t, src → dst: the small chunks src sends dst (kind, state alike);
         │ a large chunk travels alone (a row of one tensor: packing it copies nothing)
         ▼
    pack: consecutive rows of one tensor → one slice (a view: no copy);
          small rows anywhere → one gather (a copy cheaper than an op per chunk)
         │ send: one copy, recorded as one transfer per chunk (bytes unchanged)
         ▼
    dst: combine(received [k, L], pack(own rows) [k, L])   one op → a new [k, L] tensor,
         whose rows are the k slots from now on

Every element goes through the ``combine`` and ``finish`` it would chunk by chunk, in
the same order: results are bitwise the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import tensorflow as tf

from towers.devices import canonical_device, one_memory
from towers.guard.arguments import positive_int

__all__ = ["FUSE_BELOW", "Row", "assemble", "materialize", "pack", "pad_rows", "pad_split",
           "per_tower", "row_of", "small", "unsplit"]

T = TypeVar("T")


class Row(NamedTuple):
    """Row ``row`` of the 2-D tensor ``base`` ([rows, length]): one slot's value."""

    base: tf.Tensor
    row: int


def pad_rows(x: tf.Tensor, pieces: int) -> tuple[tf.Tensor, tuple[int, ...], int]:
    """``(rows, shape, size)``: ``x`` (static shape) flattened, zero-padded and viewed as
    ``[pieces, ⌈size/pieces⌉]`` on its device, with its shape and element count."""
    shape, size = tuple(int(d) for d in x.shape), int(x.shape.num_elements())
    length = -(-size // pieces)  # ceil: every chunk equally long, so sends are uniform
    with tf.device(x.device):
        flat = tf.reshape(x, [size])
        if length * pieces != size:
            flat = tf.pad(flat, [[0, length * pieces - size]])
        return tf.reshape(flat, [pieces, length]), shape, size


def pad_split(x: tf.Tensor, pieces: int) -> tuple[list[tf.Tensor], tuple[int, ...], int]:
    """:func:`pad_rows`' rows as 1-D chunks: ``pad_split(tf.range(5.0), 2)`` gives
    ``([0 1 2], [3 4 0]), (5,), 5``, what :func:`unsplit` needs to undo it."""
    pieces = positive_int("pieces", pieces)
    if not x.shape.is_fully_defined():
        raise ValueError(f"pad_split needs a static shape, got {x.shape}")
    rows, shape, size = pad_rows(x, pieces)
    with tf.device(x.device):
        # split the [pieces, length] view along its rows, not the flat vector: where a row
        # is a whole number of alignment units TensorFlow hands out views, not copies
        chunks = [tf.reshape(c, [-1]) for c in tf.split(rows, pieces)] if pieces > 1 \
            else [tf.reshape(rows, [-1])]
    return chunks, shape, size


def unsplit(chunks: Sequence[tf.Tensor], shape: Sequence[int], size: int) -> tf.Tensor:
    """Undo :func:`pad_split` on the chunks' one device (move them there with ``send``)."""
    if not chunks:
        raise ValueError("unsplit needs at least one chunk")
    device = canonical_device(chunks[0].device)
    for i, c in enumerate(chunks):
        if canonical_device(c.device) != device:
            raise ValueError(
                f"chunks[{i}] is on {canonical_device(c.device)}, chunks[0] on {device}: "
                "send them to one device before unsplit"
            )
    total = sum(int(c.shape[0]) for c in chunks)
    if total < size:
        raise ValueError(f"chunks hold {total} elements, fewer than size={size}")
    with tf.device(chunks[0].device):
        flat = tf.concat(list(chunks), 0) if len(chunks) > 1 else chunks[0]
        if total != size:
            flat = flat[:size]
        return tf.reshape(flat, list(shape))


def row_of(x: tf.Tensor) -> Row:
    """A tensor as a one-row slot (flattened; the caller keeps its shape)."""
    with tf.device(x.device):
        return Row(tf.reshape(x, [1, -1]), 0)


FUSE_BELOW = 1 << 16
"""Rows lighter than this (bytes) are gathered into one message even when not consecutive
(below it an op costs more than copying the rows)."""


def small(r: Row) -> bool:
    """The row weighs less than :data:`FUSE_BELOW` bytes."""
    return int(r.base.shape[1]) * r.base.dtype.size < FUSE_BELOW


def pack(rows: Sequence[Row | None]) -> tf.Tensor:
    """The rows as one ``[len(rows), L]`` tensor, under the caller's device scope: a slice
    per run of one tensor's rows, or one gather when :func:`small`."""
    segments: list[tuple[tf.Tensor, list[int]]] = []
    for r in rows:
        if r is None:
            raise ValueError("an empty slot cannot be packed (the schedule sends a chunk "
                             "its tower does not hold)")
        if segments and segments[-1][0] is r.base:
            segments[-1][1].append(r.row)
        else:
            segments.append((r.base, [r.row]))
    bases = {id(base): base for base, _ in segments}
    if len(segments) > len(bases) and all(small(r) for r in rows if r is not None):
        return _by_base(rows, bases)
    parts = [part for base, picked in segments for part in _take(base, picked)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)


def _by_base(rows: Sequence[Row | None], bases: dict[int, tf.Tensor]) -> tf.Tensor:
    """Small rows interleaved from several tensors: one gather per tensor, one concat,
    one gather back into order (ops per tensor, not per row)."""
    picked: dict[int, list[int]] = {key: [] for key in bases}
    slot: list[tuple[int, int]] = []
    for r in rows:
        assert r is not None  # pack() checked
        slot.append((id(r.base), len(picked[id(r.base)])))
        picked[id(r.base)].append(r.row)
    offsets, parts, at = {}, [], 0
    for key, base in bases.items():
        offsets[key], at = at, at + len(picked[key])
        parts.append(tf.gather(base, picked[key]))
    return tf.gather(tf.concat(parts, 0), [offsets[key] + i for key, i in slot])


def _take(base: tf.Tensor, picked: list[int]) -> list[tf.Tensor]:
    """Rows ``picked`` of ``base``, as few tensors as copy nothing large."""
    runs: list[list[int]] = []
    for i in picked:
        if runs and runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, i + 1])
    if len(runs) > 1 and small(Row(base, 0)):
        return [tf.gather(base, picked)]
    return [base if (a, b) == (0, int(base.shape[0])) else base[a:b] for a, b in runs]


def materialize(r: Row, shape: Sequence[int]) -> tf.Tensor:
    """The slot as a tensor of ``shape``, under the caller's device scope."""
    row = r.base if int(r.base.shape[0]) == 1 else r.base[r.row:r.row + 1]
    return tf.reshape(row, list(shape))


def per_tower(devices: Sequence[str], fn: Callable[[int], T]) -> list[T]:
    """``[fn(tower) for tower]``, each call under its tower's device (local work, no move)."""
    out = []
    for tower, device in enumerate(devices):
        with tf.device(device):
            out.append(fn(tower))
    return out


def assemble(held: Sequence[Sequence[tf.Tensor]], devices: Sequence[str],
             build: Callable[[int], tf.Tensor]) -> list[tf.Tensor]:
    """``build(tower)`` on each device; where the towers share one memory, ``build(0)`` once,
    tower ``i``'s copy waiting for its chunks ``held[i]`` so no send is pruned."""
    shared = one_memory(devices)
    outputs: list[tf.Tensor] = []
    for tower, device in enumerate(devices):
        with tf.device(device):
            if shared and outputs:
                with tf.control_dependencies(list(held[tower])):
                    outputs.append(tf.identity(outputs[0]))
            else:
                outputs.append(build(tower))
    return outputs
