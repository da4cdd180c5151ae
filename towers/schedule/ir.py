"""A collective as data: towers, chunks, and per tick the steps that move them.

A :class:`Schedule` is a frozen, TensorFlow-free collective over ``towers`` towers whose
buffer is cut into ``chunks`` equal pieces. Tick ``t`` is a tuple of :class:`Step`
``(src, dst, chunk, kind)``:

* ``copy``: ``dst``'s slot for ``chunk`` becomes ``src``'s (overwritten);
* ``reduce``: ``dst``'s slot becomes ``dst ⊕ src`` (``combine(received, own)``,
  the received partial on the left); into an empty slot it is a plain receive.

A tick's steps read the slots as the tick began, then write; several ``reduce`` steps into
one slot apply in the order listed. ``owners[c]`` is the tower that ends with chunk ``c``
reduced (reduce-scatter) or starts with it (all-gather; broadcast: the root). ``L``
elements are zero-padded to ``chunks·⌈L/chunks⌉``, so a step moves ``⌈L/chunks⌉·itemsize`` bytes.

Example:
    >>> s = Schedule("pair", 2, 1, ((Step(0, 1, 0, "reduce"),), (Step(1, 0, 0, "copy"),)))
    >>> bytes_sent(s, 40, 4), s.num_ticks
    ([40, 40], 2)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

from towers.guard.arguments import check_choice, positive_int

__all__ = ["COLLECTIVES", "KINDS", "Generator", "Schedule", "Step", "bytes_sent", "chunk_bytes",
           "cost", "format_schedule"]

KINDS = ("copy", "reduce")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


class Step(NamedTuple):
    """One transfer: tower ``src`` sends its slot for ``chunk`` to ``dst`` (``copy``|``reduce``)."""

    src: int
    dst: int
    chunk: int
    kind: str


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A collective over ``towers`` towers and ``chunks`` chunks, ``ticks[t]`` run at once;
    ``owners`` defaults to chunk ``c`` owned by tower ``c mod n`` (``broadcast``: tower 0)."""

    name: str
    towers: int
    chunks: int
    ticks: tuple[tuple[Step, ...], ...]
    collective: str = "all_reduce"
    owners: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        positive_int("towers", self.towers)
        positive_int("chunks", self.chunks)
        check_choice("collective", self.collective, COLLECTIVES)
        ticks = tuple(tuple(Step(*step) for step in tick) for tick in self.ticks)
        object.__setattr__(self, "ticks", ticks)
        for _, step in self.steps():
            if step.kind not in KINDS:
                raise ValueError(f"step kind must be 'copy' or 'reduce', got {step!r}")
        owners = self.owners
        if owners is None:
            root = self.collective == "broadcast"
            owners = tuple(0 if root else c % self.towers for c in range(self.chunks))
        owners = tuple(int(o) for o in owners)
        if len(owners) != self.chunks or not all(0 <= o < self.towers for o in owners):
            raise ValueError(f"owners must name a tower for each of {self.chunks} chunks")
        if self.collective == "broadcast" and len(set(owners)) > 1:
            raise ValueError(f"a broadcast has one root: owners must be one tower, got {owners}")
        object.__setattr__(self, "owners", owners)

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def steps(self) -> Iterable[tuple[int, Step]]:
        """Every ``(tick, step)`` in order."""
        return ((t, step) for t, tick in enumerate(self.ticks) for step in tick)

    def chunk_owner(self, chunk: int) -> int:
        assert self.owners is not None  # set in __post_init__
        return self.owners[chunk]


Generator = Callable[[int], Schedule]
"""A schedule generator: ``n -> Schedule`` for ``n`` towers."""


def chunk_bytes(schedule: Schedule, nbytes: int, itemsize: int) -> int:
    """Bytes one step moves: ``⌈L/chunks⌉·itemsize`` for ``L = nbytes/itemsize`` elements."""
    if itemsize < 1 or nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"nbytes must be a multiple of itemsize; got {nbytes}, {itemsize}")
    return -(-(nbytes // itemsize) // schedule.chunks) * itemsize


def bytes_sent(schedule: Schedule, nbytes: int, itemsize: int) -> list[int]:
    """Bytes each tower sends: its number of steps × :func:`chunk_bytes`."""
    size = chunk_bytes(schedule, nbytes, itemsize)
    counts = Counter(step.src for _, step in schedule.steps())
    return [counts[tower] * size for tower in range(schedule.towers)]


def cost(schedule: Schedule, nbytes: float) -> tuple[float, float, float]:
    """α-β-γ coefficients: each non-empty tick costs one ``α``, the most chunks any tower
    sends in it (× ``S/chunks``) ``β`` and the most chunks any tower reduces in it ``γ``."""
    piece = nbytes / schedule.chunks
    a, b, c = 0, 0.0, 0.0
    for tick in schedule.ticks:
        if not tick:
            continue
        sends = Counter(step.src for step in tick)
        reduces = Counter(step.dst for step in tick if step.kind == "reduce")
        a += 1
        b += max(sends.values()) * piece
        c += max(reduces.values(), default=0) * piece
    return a, b, c


def format_schedule(schedule: Schedule) -> str:
    """The schedule as text: towers × ticks, each cell the chunks a tower sends and where.

    ``c0c1+▶2``: chunks 0 and 1 reduced into tower 2; ``c3 ▶0``: chunk 3 copied to tower 0.

    Example:
        >>> print(format_schedule(Schedule("x", 2, 1, ((Step(0, 1, 0, "reduce"),),))))
        tick          0
        tower 0  c0+▶1
        tower 1
    """
    cells = [["" for _ in schedule.ticks] for _ in range(schedule.towers)]
    for t, tick in enumerate(schedule.ticks):
        groups: dict[tuple[int, int, str], list[int]] = {}
        for step in tick:
            groups.setdefault((step.src, step.dst, step.kind), []).append(step.chunk)
        for (src, dst, kind), chunks in groups.items():
            text = "".join(f"c{c}" for c in sorted(chunks)) + ("+" if kind == "reduce" else " ")
            cells[src][t] = " ".join(filter(None, [cells[src][t], f"{text}▶{dst}"]))
    width = max([1, *(len(cell) for row in cells for cell in row)])
    lines = ["tick     " + " ".join(str(t).rjust(width) for t in range(schedule.num_ticks))]
    lines += [(f"tower {i:<3}" + " ".join(cell.rjust(width) for cell in row)).rstrip()
              for i, row in enumerate(cells)]
    return "\n".join(lines)
