"""Communication primitives: :func:`send` is the one place where data moves.

Every algorithm in :mod:`towers.allreduce` moves data only through :func:`send`,
an explicit copy under ``tf.device(dst)``. That makes communication visible: a
:func:`record` block collects one :class:`Transfer` per send (source,
destination, bytes, and the tick and chunk the algorithm says it belongs to), so
tests can check byte counts against formulas and ``towers trace`` can draw the
schedule.

Sends are recorded when the Python code runs, i.e. at trace time inside a
``tf.function``. Sizes come from static shapes; a tensor of unknown size is
recorded with ``nbytes=None``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from towers.devices import canonical_device

__all__ = ["Recorder", "Transfer", "record", "send"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One recorded copy from ``src`` to ``dst``."""

    src: str
    dst: str
    nbytes: int | None
    tick: int | None = None
    chunk: int | None = None
    note: str = ""


@dataclasses.dataclass
class Recorder:
    """The transfers seen inside one :func:`record` block."""

    transfers: list[Transfer] = dataclasses.field(default_factory=list)

    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per source device (unknown sizes count as 0)."""
        out: dict[str, int] = {}
        for t in self.transfers:
            out[t.src] = out.get(t.src, 0) + (t.nbytes or 0)
        return out

    def bytes_per_link(self) -> dict[tuple[str, str], int]:
        """Bytes per directed link ``(src, dst)``."""
        out: dict[tuple[str, str], int] = {}
        for t in self.transfers:
            out[(t.src, t.dst)] = out.get((t.src, t.dst), 0) + (t.nbytes or 0)
        return out

    def ticks(self) -> int:
        """Number of distinct ticks the algorithm annotated (0 when none)."""
        return len({t.tick for t in self.transfers if t.tick is not None})


_ACTIVE: list[Recorder] = []


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Collect every :func:`send` made inside the block (nesting is allowed)."""
    recorder = Recorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)


def _nbytes(x: tf.Tensor) -> int | None:
    if not x.shape.is_fully_defined():
        return None
    return int(x.shape.num_elements()) * x.dtype.size


def send(
    x: tf.Tensor, dst: str, *, tick: int | None = None, chunk: int | None = None, note: str = ""
) -> tf.Tensor:
    """Copy ``x`` to device ``dst`` and record the transfer.

    A send to the device ``x`` already lives on is free: ``x`` comes back unchanged
    and nothing is recorded.

    Args:
        x: the tensor to move (it must have a device).
        dst: destination device name.
        tick: the algorithm step this transfer belongs to (for traces and counts).
        chunk: which chunk of the buffer moves (for traces).
        note: free text, e.g. ``"reduce-scatter"``.
    """
    src = canonical_device(x.device)
    dst = canonical_device(dst)
    if src == dst:
        return x
    with tf.device(dst):
        y = tf.identity(x)
    for recorder in _ACTIVE:
        recorder.transfers.append(Transfer(src, dst, _nbytes(x), tick, chunk, note))
    return y
