"""Run a :class:`~towers.schedule.Schedule` on TensorFlow devices: one interpreter for all.

:func:`run_schedule` proves the schedule first (:func:`towers.schedule.simulate`,
so a wrong schedule never reaches a device), cuts every tower's value into
``schedule.chunks`` equal pieces with :func:`~towers.allreduce.primitives.pad_split`
(zero padding at the end, the rule :mod:`towers.schedule.ir` counts bytes with),
then runs tick by tick: every step's source slot is sent with
``send(..., tick=t, chunk=c)`` first (a tick reads its slots as they were when it
began), then each destination writes: ``copy`` replaces its slot, ``reduce``
computes ``combine(received, own)`` (into an empty slot: the received value).
A slot is finished (``mean`` divides) exactly once, on the tower where its last
contribution is added; copies carry the finished value, so every output is
bitwise the same. Slots complete from the start (``n = 1``) are finished at the end.

Example:
    >>> outs = run_schedule(ring_schedule(3), values, op="mean")   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from towers.allreduce.base import AllReduce, check_values, combine, finish
from towers.allreduce.primitives import pad_split, send, unsplit
from towers.allreduce.registry import Configured
from towers.schedule.ir import Schedule
from towers.schedule.symbolic import simulate

__all__ = ["Scheduled", "generator_of", "run_schedule", "scheduled"]


def run_schedule(
    schedule: Schedule, values: Sequence[tf.Tensor], *, op: str = "sum"
) -> list[tf.Tensor]:
    """All-reduce ``values`` by following ``schedule``; output ``i`` on input ``i``'s device.

    Args:
        schedule: an ``all_reduce`` schedule for ``len(values)`` towers.
        values: one tensor per tower (static shapes), checked with ``check_values``.
        op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
        One reduced tensor per tower, each of the inputs' shape, all bitwise equal.

    Raises:
        ValueError: bad values, a schedule for another tower count or collective, or a
            schedule the symbolic checker rejects (:class:`towers.schedule.ScheduleError`).
    """
    devices = check_values(values, op)
    n = len(values)
    if schedule.towers != n or schedule.collective != "all_reduce":
        raise ValueError(f"{schedule.name}: an {schedule.collective} schedule for "
                         f"{schedule.towers} towers cannot all-reduce {n} values")
    simulate(schedule)
    split = [pad_split(v, schedule.chunks) for v in values]
    _, shape, size = split[0]
    slots = [list(pieces) for pieces, _, _ in split]
    full = (1 << n) - 1
    have = [[1 << t] * schedule.chunks for t in range(n)]
    done = [[False] * schedule.chunks for _ in range(n)]
    for t, tick in enumerate(schedule.ticks):
        moved = [send(slots[s.src][s.chunk], devices[s.dst], tick=t, chunk=s.chunk, note=s.kind)
                 for s in tick]
        sent = [(have[s.src][s.chunk], done[s.src][s.chunk]) for s in tick]
        for s, value, (mask, finished) in zip(tick, moved, sent):
            if s.kind == "reduce" and have[s.dst][s.chunk]:
                with tf.device(devices[s.dst]):
                    value = combine(value, slots[s.dst][s.chunk], op)
                    mask |= have[s.dst][s.chunk]
                    finished = mask == full
                    if finished:  # the last contribution arrived: finish here, once
                        value = finish(value, op, n)
            slots[s.dst][s.chunk], have[s.dst][s.chunk] = value, mask
            done[s.dst][s.chunk] = finished
    outputs = []
    for tower, device in enumerate(devices):
        with tf.device(device):
            row = [x if done[tower][c] else finish(x, op, n) for c, x in enumerate(slots[tower])]
            outputs.append(unsplit(row, shape, size))
    return outputs


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """An all-reduce defined by a schedule generator: runs ``generator(len(values))``.

    Tools find the generator here (:func:`generator_of`) to prove the algorithm with
    :func:`towers.schedule.check_schedule` as well as run it.
    """

    generator: Callable[[int], Schedule]

    def __call__(self, values: Sequence[tf.Tensor], *, op: str = "sum") -> list[tf.Tensor]:
        check_values(values, op)
        return run_schedule(self.generator(len(values)), values, op=op)

    @property
    def __name__(self) -> str:  # for code that names callables by ``__name__``
        return str(getattr(self.generator, "__name__", "scheduled"))


def scheduled(generator: Callable[[int], Schedule]) -> AllReduce:
    """The all-reduce that runs ``generator(len(values))`` with :func:`run_schedule`.

    Example:
        >>> algo = scheduled(ring_schedule); outs = algo(values, op="sum")   # doctest: +SKIP
    """
    return Scheduled(generator)


def generator_of(fn: object) -> Callable[[int], Schedule] | None:
    """The schedule generator behind an algorithm (a :class:`Scheduled`, or a registry
    :class:`~towers.allreduce.registry.Configured` running one), else None."""
    fn = getattr(fn, "run", fn) if isinstance(fn, Configured) else fn
    return fn.generator if isinstance(fn, Scheduled) else None
