"""Run a :class:`~towers.schedule.Schedule` on TensorFlow devices: one interpreter for all.

:func:`run_slots` proves the schedule (:func:`towers.schedule.simulate`), then runs it
tick by tick over ``slots[tower][chunk]``: a tick's small chunks from one tower to another
are one message (:mod:`~towers.allreduce.machinery.packed`), all sent first, then each
destination writes: ``copy`` replaces its slot, ``reduce`` computes
``combine(received, own)``. A slot is finished (``mean`` divides) once, where its last
contribution is added; copies carry the finished value, so outputs agree bitwise. This
is the one place the algorithms' ordering and rounding are decided::

    tick t:  tower 0 ──(chunks 2,3: one [2, L] tensor)──▶ tower 2: combine(recv, own[2:4])
             tower 1 ──(chunks 0,1)───────────────────▶ tower 3: combine(recv, own[0:2])

:func:`run_schedule` all-reduces with it: each value cut into ``schedule.chunks`` equal
zero-padded rows (:func:`~towers.allreduce.machinery.packed.pad_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import tensorflow as tf

from towers.allreduce.machinery.base import check_values, combine, finish
from towers.allreduce.machinery.packed import (
    Row,
    assemble,
    materialize,
    pack,
    pad_rows,
    per_tower,
    row_of,
    small,
)
from towers.allreduce.machinery.primitives import send
from towers.schedule.ir import Schedule, Step
from towers.schedule.symbolic import simulate

__all__ = ["Rows", "Scheduled", "Slots", "generator_of", "run_rows", "run_schedule", "run_slots",
           "scheduled"]

Slots = list[list[tf.Tensor | None]]
"""``slots[tower][chunk]``: the piece a tower holds of each chunk (None: none yet)."""
Rows = list[list[Row | None]]
"""``slots[tower][chunk]`` packed: the row that holds a tower's piece of each chunk."""


class _Message(NamedTuple):
    """One tick's chunks from ``src`` to ``dst`` that travel and land alike (one send)."""

    src: int
    dst: int
    kind: str
    chunks: tuple[int, ...]


def _messages(tick: Sequence[Step], slots: Rows, have: list[list[int]],
              done: list[list[bool]], full: int) -> list[_Message]:
    """The tick's steps fused per (src, dst): one message for the :func:`small` chunks that
    travel and land alike, a large chunk alone; a tick that writes a slot twice keeps one
    message per step, in order (fusing could reorder reductions)."""
    writes = [(s.dst, s.chunk) for s in tick]
    if len(set(writes)) != len(writes):
        return [_Message(s.src, s.dst, s.kind, (s.chunk,)) for s in tick]
    groups: dict[tuple, list[int]] = {}
    for s in tick:
        lands = s.kind == "reduce" and bool(have[s.dst][s.chunk])
        ends = ((have[s.src][s.chunk] | have[s.dst][s.chunk]) == full if lands
                else done[s.src][s.chunk])  # fmt: skip
        held = slots[s.src][s.chunk]
        length = -1 if held is None else int(held.base.shape[1])  # None: pack() refuses
        groups.setdefault((s.src, s.dst, s.kind, lands, ends, length), []).append(s.chunk)
    messages: list[_Message] = []
    for (src, dst, kind, *_), chunks in groups.items():
        held = slots[src][chunks[0]]
        if held is not None and not small(held):  # one length per group: all large
            messages.extend(_Message(src, dst, kind, (c,)) for c in sorted(chunks))
        else:
            messages.append(_Message(src, dst, kind, tuple(sorted(chunks))))
    return messages


def run_slots(schedule: Schedule, slots: Slots, devices: Sequence[str], op: str = "sum",
              *, note: str = "") -> Slots:
    """Follow ``schedule`` over ``slots[tower][chunk]`` (None: empty; replaced in place) on
    ``devices``; ``note`` is recorded before each step's kind; a ``ScheduleError`` if unproved.
    """
    shapes = {c: x.shape for row in slots for c, x in enumerate(row) if x is not None}
    rows: Rows = per_tower(devices, lambda t: [None if x is None else row_of(x) for x in slots[t]])
    rows = run_rows(schedule, rows, devices, op, note=note)
    for row, out, device in zip(rows, slots, devices):
        with tf.device(device):
            out[:] = [None if r is None else materialize(r, shapes[c]) for c, r in enumerate(row)]
    return slots


def run_rows(schedule: Schedule, slots: Rows, devices: Sequence[str], op: str = "sum",
             *, note: str = "", own_first: bool = False) -> Rows:
    """:func:`run_slots` over packed slots; ``own_first``: ``combine(own, received)``."""
    simulate(schedule)
    n, full = schedule.towers, (1 << schedule.towers) - 1
    reducing = schedule.collective in ("all_reduce", "reduce_scatter")
    have = [[(1 << t if reducing else full) if x is not None else 0 for x in row]
            for t, row in enumerate(slots)]
    done = [[not reducing and x is not None for x in row] for row in slots]
    for t, tick in enumerate(schedule.ticks):
        messages, moved = _messages(tick, slots, have, done, full), []
        for m in messages:
            with tf.device(devices[m.src]):
                packed = pack([slots[m.src][c] for c in m.chunks])
            moved.append(send(packed, devices[m.dst], tick=t, chunks=m.chunks,
                              note=f"{note} {m.kind}".strip()))  # fmt: skip
        sent = [([have[m.src][c] for c in m.chunks], [done[m.src][c] for c in m.chunks])
                for m in messages]
        for m, value, (masks, finished) in zip(messages, moved, sent):
            if m.kind == "reduce" and have[m.dst][m.chunks[0]]:
                with tf.device(devices[m.dst]):
                    own = pack([slots[m.dst][c] for c in m.chunks])
                    value = combine(own, value, op) if own_first else combine(value, own, op)
                    masks = [mask | have[m.dst][c] for mask, c in zip(masks, m.chunks)]
                    finished = [mask == full for mask in masks]
                    if finished[0]:  # the last contribution arrived: finish here, once
                        value = finish(value, op, n)
            for i, c in enumerate(m.chunks):
                slots[m.dst][c] = Row(value, i)
                have[m.dst][c], done[m.dst][c] = masks[i], finished[i]
    _finish_complete(slots, have, done, devices, op, n, full)
    return slots


def _finish_complete(slots: Rows, have: list[list[int]], done: list[list[bool]],
                     devices: Sequence[str], op: str, n: int, full: int) -> None:
    """Finish the slots complete from the start (``n = 1``: nothing reduced them)."""
    for tower, row in enumerate(slots):
        waiting = [c for c, r in enumerate(row)
                   if r is not None and have[tower][c] == full and not done[tower][c]]
        if waiting:
            with tf.device(devices[tower]):
                value = finish(pack([row[c] for c in waiting]), op, n)
            for i, c in enumerate(waiting):
                row[c] = Row(value, i)


def run_schedule(
    schedule: Schedule, values: Sequence[tf.Tensor], *, op: str = "sum", own_first: bool = False
) -> list[tf.Tensor]:
    """All-reduce ``values`` by following ``schedule``; ``own_first``: a ``reduce`` computes
    ``combine(own, received)`` (the trees' order; it shows in ``max`` of ``±0``)."""
    devices, n = check_values(values, op), len(values)
    if schedule.towers != n or schedule.collective != "all_reduce":
        raise ValueError(f"{schedule.name}: an {schedule.collective} schedule for "
                         f"{schedule.towers} towers cannot all-reduce {n} values")
    if not values[0].shape.is_fully_defined():
        raise ValueError(f"{schedule.name} needs a fully defined static shape, "
                         f"got {values[0].shape}")
    split = [pad_rows(v, schedule.chunks) for v in values]
    _, shape, size = split[0]
    slots: Rows = [[Row(rows, c) for c in range(schedule.chunks)] for rows, _, _ in split]
    slots = run_rows(schedule, slots, devices, op, own_first=own_first)

    def build(tower: int) -> tf.Tensor:  # one concat (none when one tensor holds all)
        flat = tf.reshape(pack(slots[tower]), [-1])
        return tf.reshape(flat[:size] if int(flat.shape[0]) != size else flat, shape)

    held = [[r.base for r in row if r is not None] for row in slots]
    return assemble(held, devices, build)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """The all-reduce that runs ``generator(len(values))`` with :func:`run_schedule`."""

    generator: Callable[[int], Schedule]
    own_first: bool = False

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        check_values(values, op)
        return run_schedule(self.generator(len(values)), values, op=op, own_first=self.own_first)

    @property
    def __name__(self) -> str:  # for code that names callables by ``__name__``
        return str(getattr(self.generator, "__name__", "scheduled"))


def generator_of(fn: object) -> Callable[[int], Schedule] | None:
    """The schedule generator behind a :class:`Scheduled` (or a ``Configured`` running one)."""
    fn = fn if isinstance(fn, Scheduled) else getattr(fn, "run", None)
    return fn.generator if isinstance(fn, Scheduled) else None


scheduled = Scheduled
