"""Recording what moves: every :func:`~towers.allreduce.machinery.primitives.send` as a
:class:`Transfer`.

This module owns the recording state and nothing that moves data. A :func:`record`
block collects one :class:`Transfer` per send (source, destination, bytes, and the
tick and chunk the algorithm says it belongs to), so tests can check byte counts
against formulas and ``towers trace`` can draw the schedule. A composite algorithm
shifts the ticks of a later phase with :func:`tick_offset`, so its phases do not
overlap in the schedule; an opaque collective that moves data outside ``send``
states what it expects to move with :func:`record_estimate`. ``send`` itself
lives in :mod:`towers.allreduce.machinery.primitives` and reports here through
:func:`log_send`.

Sends are recorded when the Python code runs, i.e. at trace time inside a
``tf.function``. Sizes come from static shapes; a tensor of unknown size is
recorded with ``nbytes=None``.

Example:
    >>> with record() as recorder:                        # doctest: +SKIP
    ...     y = send(x, "/device:CPU:1", tick=0)
    >>> recorder.bytes_sent()                             # doctest: +SKIP
    {'/job:localhost/replica:0/task:0/device:CPU:0': 16}
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import tensorflow as tf

from towers.devices import canonical_device

__all__ = [
    "Recorder",
    "StepStats",
    "Transfer",
    "log_send",
    "record",
    "record_estimate",
    "tick_offset",
]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One recorded copy from ``src`` to ``dst``."""

    src: str
    dst: str
    nbytes: int | None
    tick: int | None = None
    chunk: int | None = None
    note: str = ""
    estimated: bool = False


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
_OFFSETS: list[int] = []


@contextlib.contextmanager
def record() -> Iterator[Recorder]:
    """Collect every :func:`send` made inside the block (nesting is allowed)."""
    recorder = Recorder()
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        # By identity: recorders compare by value, and a nested one can equal its parent.
        del _ACTIVE[next(i for i, r in enumerate(_ACTIVE) if r is recorder)]


@contextlib.contextmanager
def tick_offset(k: int) -> Iterator[int]:
    """Add ``k`` to the tick of every :func:`send` inside the block (nested offsets add up).

    A composite algorithm runs its phases one after another, but each part numbers
    its ticks from 0; shifting a phase by the ticks before it keeps the recorded
    schedule sequential. Only the recorded labels change, never the data moved.

    Yields:
        The total offset now in effect (``k`` plus any enclosing offsets).

    Raises:
        TypeError: ``k`` is not an int.

    Example:
        >>> with tick_offset(3):                       # doctest: +SKIP
        ...     y = send(x, "/device:CPU:1", tick=0)   # recorded with tick=3
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"tick offset must be an int, got {type(k).__name__}")
    _OFFSETS.append(k)
    try:
        yield sum(_OFFSETS)
    finally:
        _OFFSETS.pop()


def record_estimate(src: str, dst: str, nbytes: int | None, *, note: str = "") -> None:
    """Record traffic that an opaque collective (TensorFlow's or NCCL's) makes on its own.

    Such ops do not go through :func:`send`, so their algorithm states what it expects
    them to move; the :class:`Transfer` is marked ``estimated=True``.
    """
    src, dst = canonical_device(src), canonical_device(dst)
    for recorder in _ACTIVE:
        recorder.transfers.append(Transfer(src, dst, nbytes, note=note, estimated=True))


def _nbytes(x: tf.Tensor) -> int | None:
    if not x.shape.is_fully_defined():
        return None
    return int(x.shape.num_elements()) * x.dtype.size


def log_send(
    x: tf.Tensor, src: str, dst: str, tick: int | None, chunk: int | None, note: str
) -> None:
    """Record one send of ``x`` from ``src`` to ``dst`` in every active :func:`record` block.

    ``tick`` is shifted by any enclosing :func:`tick_offset`; the size comes from
    ``x``'s static shape (None when it is not fully defined).
    """
    if tick is not None and _OFFSETS:
        tick += sum(_OFFSETS)
    for recorder in _ACTIVE:
        recorder.transfers.append(Transfer(src, dst, _nbytes(x), tick, chunk, note))


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one training step sends: per tower, per directed link, and how many ticks."""

    bytes_per_tower: dict[str, int]
    bytes_per_link: dict[tuple[str, str], int]
    ticks: int
    estimated: bool
    transfers: tuple[Transfer, ...]

    @classmethod
    def from_recorder(cls, recorder: Recorder) -> StepStats:
        """The figures of everything ``recorder`` saw (one traced step)."""
        return cls(
            bytes_per_tower=recorder.bytes_sent(),
            bytes_per_link=recorder.bytes_per_link(),
            ticks=recorder.ticks(),
            estimated=any(t.estimated for t in recorder.transfers),
            transfers=tuple(recorder.transfers),
        )
