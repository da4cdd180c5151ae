""":func:`send` is the one place data moves, and every send is recorded here.

Every algorithm moves data only through :func:`send`, an explicit copy under
``tf.device(dst)``. A :func:`record` block collects one :class:`Transfer` per send
(source, destination, bytes, and the tick and chunk the algorithm says it belongs
to), so tests check byte counts against formulas and ``towers trace`` draws the
schedule. A composite algorithm shifts a later phase's ticks with :func:`tick_offset`;
an opaque collective states what it expects to move with :func:`record_estimate`.

Sends are recorded when the Python code runs (at trace time inside a ``tf.function``);
sizes come from static shapes (``nbytes=None`` when unknown). ``record(follow_data=True)``
also finds, for each send, which earlier sends' received tensors its data was computed
from (:attr:`Recorder.sources`), so a trace tells a forwarded chunk from a tower's own.

Example:
    >>> with record() as recorder:                        # doctest: +SKIP
    ...     y = send(x, "/device:CPU:1", tick=0)
    >>> recorder.bytes_sent()                             # doctest: +SKIP
    {'/job:localhost/replica:0/task:0/device:CPU:0': 16}
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import tensorflow as tf

from towers.devices import canonical_device

__all__ = [
    "BOOKKEEPING_NOTES",
    "WEIGHT_NOTES",
    "Recorder",
    "StepStats",
    "Transfer",
    "log_send",
    "record",
    "record_estimate",
    "send",
    "tick_offset",
    "traffic_kind",
]

BOOKKEEPING_NOTES = frozenset({"loss", "state", "guard", "loss-scale"})
"""Notes of a step's bookkeeping sends: losses, example counts, state, guard, loss scale."""

WEIGHT_NOTES = frozenset({"read-weights"})
"""Notes of weight reads (``parameter_device``: each tower reads the weights it runs)."""


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
    """Copy ``x`` to device ``dst`` and record the transfer (a send to ``x``'s own device
    returns ``x`` and records nothing).

    Args:
        x: the tensor to move (it must have a device).
        dst: destination device name.
        tick: the algorithm step this transfer belongs to; shifted by any :func:`tick_offset`.
        chunk: which chunk of the buffer moves (for traces).
        note: what it carries, e.g. ``"reduce-scatter"`` (see :func:`traffic_kind`).
        src: where ``x`` lives, for a tensor whose ``.device`` is empty (a variable read
            inside ``tf.function`` is colocated with its variable but carries no name).
        chunks: ``x`` packs one chunk per row (``x[i]`` is chunk ``chunks[i]``): one copy,
            recorded as one transfer per chunk (``chunk`` is then ignored).
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


def traffic_kind(note: str) -> str:
    """What a transfer with ``note`` carries: ``"bookkeeping"``, ``"weights"`` or
    ``"gradients"`` (everything the reducer and the placement send)."""
    if note in BOOKKEEPING_NOTES:
        return "bookkeeping"
    return "weights" if note in WEIGHT_NOTES else "gradients"


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
    """The transfers seen inside one :func:`record` block; ``sources[i]`` (``follow_data``):
    the nearest earlier transfers whose received tensor transfer ``i``'s was computed from.
    """

    transfers: list[Transfer] = dataclasses.field(default_factory=list)
    follow_data: bool = False
    sources: list[frozenset[int] | None] = dataclasses.field(default_factory=list)
    _received: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    _memo: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict, repr=False)

    def add(self, transfer: Transfer, x: Any = None, out: Any = None) -> None:
        """Append one transfer; with ``follow_data``, find what ``x`` was computed from."""
        sources = None
        if self.follow_data and _symbolic(x):
            sources = self._sources_of(x)
        self.transfers.append(transfer)
        self.sources.append(sources)
        if self.follow_data and _symbolic(out):
            self._received[out.op.name] = len(self.transfers) - 1

    def _sources_of(self, x: Any) -> frozenset[int]:
        """The nearest received tensors among ``x``'s ancestors (iterative, memoized)."""
        stack, memo = [x.op], self._memo
        while stack:
            op = stack[-1]
            if op.name in memo:
                stack.pop()
                continue
            parents = [t.op for t in op.inputs] + list(op.control_inputs)
            todo = [p for p in parents if p.name not in memo and p.name not in self._received]
            if todo:
                stack.extend(todo)
                continue
            found: set[int] = set()
            for p in parents:
                found |= {self._received[p.name]} if p.name in self._received else memo[p.name]
            memo[op.name] = frozenset(found)
            stack.pop()
        if x.op.name in self._received:
            return frozenset({self._received[x.op.name]})
        return memo[x.op.name]

    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per source device (unknown sizes count as 0)."""
        return _per_source(self.transfers)

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


def _symbolic(x: Any) -> bool:
    """True for a graph tensor (inside a ``tf.function``), whose inputs can be followed."""
    return x is not None and tf.is_symbolic_tensor(x) and hasattr(x, "op")


@contextlib.contextmanager
def record(*, follow_data: bool = False) -> Iterator[Recorder]:
    """Collect every :func:`send` made inside the block (nesting is allowed).

    Args:
        follow_data: also fill :attr:`Recorder.sources` for sends traced in a graph.
    """
    recorder = Recorder(follow_data=follow_data)
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        # By identity: recorders compare by value, and a nested one can equal its parent.
        del _ACTIVE[next(i for i, r in enumerate(_ACTIVE) if r is recorder)]


@contextlib.contextmanager
def tick_offset(k: int) -> Iterator[int]:
    """Add ``k`` (an int) to the tick of every :func:`send` inside the block (nested offsets
    add up), so a composite algorithm's later phase follows the earlier one in the recorded
    schedule (only labels change, never data); yields the total offset in effect.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"tick offset must be an int, got {type(k).__name__}")
    _OFFSETS.append(k)
    try:
        yield sum(_OFFSETS)
    finally:
        _OFFSETS.pop()


def record_estimate(src: str, dst: str, nbytes: int | None, *, note: str = "") -> None:
    """Record traffic an opaque collective makes outside :func:`send` (``estimated=True``)."""
    src, dst = canonical_device(src), canonical_device(dst)
    transfer = Transfer(src, dst, nbytes, note=note, estimated=True)
    for recorder in _ACTIVE:  # one object in every block: a nested one's are its parent's
        recorder.add(transfer)


def log_send(
    x: tf.Tensor, src: str, dst: str, tick: int | None, chunk: int | None, note: str,
    out: tf.Tensor | None = None,
) -> None:
    """Record one send of ``x`` in every active :func:`record` block (``tick`` shifted by
    any :func:`tick_offset`; ``out``: the received tensor, for ``follow_data``)."""
    if tick is not None and _OFFSETS:
        tick += sum(_OFFSETS)
    nbytes = int(x.shape.num_elements()) * x.dtype.size if x.shape.is_fully_defined() else None
    transfer = Transfer(src, dst, nbytes, tick, chunk, note)
    for recorder in _ACTIVE:
        recorder.add(transfer, x, out)


def _per_source(transfers: Sequence[Transfer], kind: str | None = None) -> dict[str, int]:
    """Bytes per source device of the transfers (of one :func:`traffic_kind`, if given)."""
    out: dict[str, int] = {}
    for t in transfers:
        if kind is None or traffic_kind(t.note) == kind:
            out[t.src] = out.get(t.src, 0) + (t.nbytes or 0)
    return out


@dataclasses.dataclass(frozen=True)
class StepStats:
    """What one training step sends: per tower, per directed link, and how many ticks.

    The ``*_bytes_per_tower`` fields split ``bytes_per_tower`` by :func:`traffic_kind`
    (a source with none of a kind is left out); the three add up to it.
    """

    bytes_per_tower: dict[str, int]
    bytes_per_link: dict[tuple[str, str], int]
    ticks: int
    estimated: bool
    transfers: tuple[Transfer, ...]
    gradient_bytes_per_tower: dict[str, int] = dataclasses.field(default_factory=dict)
    bookkeeping_bytes_per_tower: dict[str, int] = dataclasses.field(default_factory=dict)
    weight_bytes_per_tower: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def gradient_bytes(self) -> int:
        """Gradient bytes sent by all devices together in one step."""
        return sum(self.gradient_bytes_per_tower.values())

    @property
    def bookkeeping_bytes(self) -> int:
        """Bookkeeping bytes (loss, state, guard, loss scale) sent in one step."""
        return sum(self.bookkeeping_bytes_per_tower.values())

    @classmethod
    def from_recorder(cls, recorder: Recorder) -> StepStats:
        """The figures of everything ``recorder`` saw (one traced step)."""
        transfers = list(recorder.transfers)
        return cls(
            bytes_per_tower=recorder.bytes_sent(),
            bytes_per_link=recorder.bytes_per_link(),
            ticks=recorder.ticks(),
            estimated=any(t.estimated for t in transfers),
            transfers=tuple(transfers),
            gradient_bytes_per_tower=_per_source(transfers, "gradients"),
            bookkeeping_bytes_per_tower=_per_source(transfers, "bookkeeping"),
            weight_bytes_per_tower=_per_source(transfers, "weights"),
        )
