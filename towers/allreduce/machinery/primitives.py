"""Communication primitives: :func:`send` is the one place where data moves.

Every algorithm in :mod:`towers.allreduce` moves data only through :func:`send`,
an explicit copy under ``tf.device(dst)``. That makes communication visible: a
:func:`record` block collects one :class:`Transfer` per send (source,
destination, bytes, and the tick and chunk the algorithm says it belongs to), so
tests can check byte counts against formulas and ``towers trace`` can draw the
schedule. A composite algorithm shifts the ticks of a later phase with
:func:`tick_offset`, so its phases do not overlap in the schedule. The recording
machinery (:class:`Transfer`, :class:`Recorder`, :func:`record`,
:func:`tick_offset`, :func:`record_estimate`) lives in
:mod:`towers.allreduce.machinery.recording` and is re-exported here.

Below :func:`send` sit the chores :func:`pad_split` / :func:`unsplit`. Every
schedule — the ring, the trees, the public reduce-scatter, all-gather and
broadcast — runs through the one interpreter,
:mod:`towers.allreduce.machinery.scheduled`, which moves data only by :func:`send`.

Sends are recorded when the Python code runs, i.e. at trace time inside a
``tf.function``. Sizes come from static shapes; a tensor of unknown size is
recorded with ``nbytes=None``.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.packed import pad_rows
from towers.allreduce.machinery.recording import (
    Recorder,
    Transfer,
    log_send,
    record,
    record_estimate,
    tick_offset,
)
from towers.devices import canonical_device
from towers.guard.arguments import positive_int

__all__ = [
    "Recorder",
    "Transfer",
    "pad_split",
    "record",
    "record_estimate",
    "send",
    "tick_offset",
    "unsplit",
]


def send(
    x: tf.Tensor,
    dst: str,
    *,
    tick: int | None = None,
    chunk: int | None = None,
    note: str = "",
    src: str | None = None,
    chunks: Sequence[int] | None = None,
) -> tf.Tensor:
    """Copy ``x`` to device ``dst`` and record the transfer.

    A send to the device ``x`` already lives on is free: ``x`` comes back unchanged
    and nothing is recorded.

    Args:
        x: the tensor to move (it must have a device).
        dst: destination device name.
        tick: the algorithm step this transfer belongs to (for traces and counts);
            shifted by any enclosing :func:`tick_offset`.
        chunk: which chunk of the buffer moves (for traces).
        note: free text, e.g. ``"reduce-scatter"``.
        src: where ``x`` lives, for a tensor whose ``.device`` is empty (a variable read
            inside ``tf.function`` is colocated with its variable but carries no name).
        chunks: ``x`` packs one chunk per row (``x[i]`` is chunk ``chunks[i]``): one copy
            moves them, recorded as one transfer per chunk (``chunk`` is then ignored), so
            counts and traces are those of the chunks sent one by one.
    """
    src = canonical_device(x.device) or canonical_device(src or "")
    dst = canonical_device(dst)
    if src == dst:
        return x
    with tf.device(dst):
        y = tf.identity(x)
    if chunks is None:
        log_send(x, src, dst, tick, chunk, note, out=y)
    else:
        row = tf.TensorSpec(x.shape[1:], x.dtype)  # what one chunk weighs
        for c in chunks:
            log_send(row, src, dst, tick, c, note)
    return y


def pad_split(x: tf.Tensor, pieces: int) -> tuple[list[tf.Tensor], tuple[int, ...], int]:
    """Flatten ``x``, zero-pad it to a multiple of ``pieces`` elements and split it evenly.

    Every chunk has ``ceil(size / pieces)`` elements; the padding (at most
    ``pieces - 1`` zeros) sits at the end of the last chunks. The ops run on
    ``x``'s device. Scalars and empty tensors work (an empty tensor gives
    ``pieces`` empty chunks).

    Args:
        x: a tensor with a fully defined static shape.
        pieces: the number of chunks, at least 1.

    Returns:
        ``(chunks, shape, size)``: the list of 1-D chunks, ``x``'s shape as a tuple,
        and its element count, which is what :func:`unsplit` needs to undo this.

    Raises:
        ValueError: ``pieces`` < 1 or not an int, or ``x`` has no static shape.

    Example:
        >>> chunks, shape, size = pad_split(tf.range(5.0), 2)   # [0 1 2] [3 4 0]
    """
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
    """Undo :func:`pad_split`: concatenate, strip the padding, restore the shape.

    The chunks must all be on one device (concatenating across devices would be a
    hidden copy: move them with :func:`send` first); the ops run there.

    Args:
        chunks: 1-D chunks in order, all on one device.
        shape: the original shape.
        size: the original element count (``prod(shape)``).

    Returns:
        A tensor of ``shape`` on the chunks' device.

    Raises:
        ValueError: no chunks, chunks on different devices, or too few elements.

    Example:
        >>> x = unsplit(*pad_split(tf.ones([2, 3]), 4))   # back to shape [2, 3]
    """
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
