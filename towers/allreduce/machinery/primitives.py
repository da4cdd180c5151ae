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

Below :func:`send` sit the ring phases research code composes
(:func:`reduce_scatter`, :func:`all_gather`), the flat :func:`reduce` and the
chores :func:`pad_split` / :func:`unsplit`; they move data only by :func:`send`.
(The public collectives, one signature each, are
:mod:`towers.allreduce.hand_collectives`: a flat broadcast is
``broadcast(x, devices, root=src, algorithm="flat")``.)

Sends are recorded when the Python code runs, i.e. at trace time inside a
``tf.function``. Sizes come from static shapes; a tensor of unknown size is
recorded with ``nbytes=None``.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import check_values, combine, finish
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
    "all_gather",
    "pad_split",
    "record",
    "record_estimate",
    "reduce",
    "reduce_scatter",
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


# ---------------------------------------------------------------------------
# Collective building blocks, composed from send() for research code.
#
# Lists are indexed ``chunks[tower][chunk]``: the outer index names the tower
# (and ``devices[tower]`` its device), the inner one the piece of the buffer.
# ---------------------------------------------------------------------------

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


def _ring_order(n: int, order: Sequence[int] | None) -> list[int]:
    """The ring as a list of towers by position (default ``0, 1, ..., n-1``), checked."""
    ring = list(range(n)) if order is None else [int(t) for t in order]
    if sorted(ring) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {ring}")
    return ring


def _check_grid(chunks: Sequence[Sequence[tf.Tensor]], devices: Sequence[str]) -> int:
    n = len(devices)
    if n == 0:
        raise ValueError("devices is empty: expected one device per tower")
    if len(chunks) != n:
        raise ValueError(f"chunks has {len(chunks)} towers for {n} devices")
    for tower, row in enumerate(chunks):
        if len(row) != n:
            raise ValueError(
                f"chunks[{tower}] has {len(row)} chunks; a ring needs one per tower ({n})"
            )
    return n


def reduce_scatter(
    chunks: Sequence[Sequence[tf.Tensor]],
    devices: Sequence[str],
    op: str,
    tick0: int = 0,
    *,
    order: Sequence[int] | None = None,
    chunk_ids: Sequence[int] | None = None,
) -> list[tf.Tensor]:
    """Ring reduce-scatter: the tower at ring position ``k`` ends with chunk ``k`` fully reduced.

    At tick ``tick0 + t`` (``t = 0 .. n-2``) the tower at ring position ``p`` sends
    its running partial of chunk ``(p - 1 - t) mod n`` to position ``p + 1``, which
    combines it with its own copy (``combine(received, own)``). Chunk ``k`` thus
    starts at position ``k + 1`` and its last combination happens at position ``k``,
    which then finishes it (``mean`` divides by ``n``) exactly once.

    Args:
        chunks: ``chunks[tower][k]``, ``n`` equally shaped chunks per tower, each on
            ``devices[tower]``.
        devices: one device per tower.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"`` (pass ``"sum"`` and finish
            yourself when this is one stage of a larger reduction).
        tick0: the tick label of the first step (for traces).
        order: the ring as towers by position (default ``range(n)``).
        chunk_ids: labels recorded for chunk ``k`` (default ``k``).

    Returns:
        ``owned[tower]``: the finished chunk ``order.index(tower)``, on that tower.

    Example:
        >>> owned = reduce_scatter([pad_split(v, n)[0] for v in values], devices, "sum")
    """
    n = _check_grid(chunks, devices)
    ring = _ring_order(n, order)
    ids = list(range(n)) if chunk_ids is None else list(chunk_ids)
    partial = [chunks[ring[(k + 1) % n]][k] for k in range(n)]
    for t in range(n - 1):
        for k in range(n):
            dst = ring[(k + 2 + t) % n]
            with tf.device(devices[dst]):
                moved = send(partial[k], devices[dst], tick=tick0 + t, chunk=ids[k],
                             note="reduce-scatter")
                partial[k] = combine(moved, chunks[dst][k], op)
    owned: list[tf.Tensor] = [None] * n
    for k in range(n):
        with tf.device(devices[ring[k]]):
            owned[ring[k]] = finish(partial[k], op, n)
    return owned


def all_gather(
    owned: Sequence[tf.Tensor],
    devices: Sequence[str],
    tick0: int = 0,
    *,
    order: Sequence[int] | None = None,
    chunk_ids: Sequence[int] | None = None,
) -> list[list[tf.Tensor]]:
    """Ring all-gather: every tower ends with every tower's block, in ring-position order.

    At tick ``tick0 + t`` (``t = 0 .. n-2``) the tower at ring position ``p`` copies
    block ``(p - t) mod n`` to position ``p + 1``. Blocks are only copied, so every
    tower's copy of a block is bitwise the same.

    Args:
        owned: ``owned[tower]``, the block of the tower's ring position, on its device
            (what :func:`reduce_scatter` returns).
        devices: one device per tower.
        tick0: the tick label of the first step.
        order: the ring as towers by position (default ``range(n)``).
        chunk_ids: labels recorded for block ``k`` (default ``k``).

    Returns:
        ``gathered[tower][k]``: block ``k`` (the one owned by ``order[k]``) on
        ``devices[tower]``.

    Example:
        >>> gathered = all_gather(reduce_scatter(chunks, devices, "sum"), devices, tick0=n - 1)
    """
    n = len(devices)
    if len(owned) != n or n == 0:
        raise ValueError(f"owned has {len(owned)} blocks for {n} devices")
    ring = _ring_order(n, order)
    ids = list(range(n)) if chunk_ids is None else list(chunk_ids)
    gathered: list[list[tf.Tensor]] = [[None] * n for _ in range(n)]
    for k in range(n):
        gathered[ring[k]][k] = owned[ring[k]]
    for t in range(n - 1):
        for k in range(n):
            src, dst = ring[(k + t) % n], ring[(k + t + 1) % n]
            gathered[dst][k] = send(gathered[src][k], devices[dst], tick=tick0 + t,
                                    chunk=ids[k], note="all-gather")
    return gathered


def reduce(values: Sequence[tf.Tensor], root: int, op: str, *, tick: int = 0) -> tf.Tensor:
    """Flat reduce: every tower sends its value to tower ``root``, which combines in tower order.

    The result is ``((x0 op x1) op x2) ...`` on ``root``'s device, finished once
    (``mean`` divides by ``len(values)``).

    Args:
        values: one tensor per tower, checked with :func:`check_values`.
        root: the index of the receiving tower.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
        tick: the tick label of the sends.

    Returns:
        The reduction, on ``values[root]``'s device. Cost: ``root`` receives ``(n-1)·S``.

    Raises:
        ValueError: from :func:`check_values`, or ``root`` out of range.

    Example:
        >>> total = reduce(values, 0, "sum")
    """
    devices = check_values(values, op)
    if not 0 <= root < len(devices):
        raise ValueError(f"root={root} is not a tower index for {len(devices)} values")
    dst = devices[root]
    with tf.device(dst):
        total = send(values[0], dst, tick=tick, chunk=0, note="reduce")
        for i, v in enumerate(values[1:], start=1):
            total = combine(total, send(v, dst, tick=tick, chunk=i, note="reduce"), op)
        return finish(total, op, len(values))
