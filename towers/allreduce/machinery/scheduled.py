"""Run a :class:`~towers.schedule.Schedule` on TensorFlow devices: one interpreter for all.

:func:`run_slots` is the interpreter, for every collective the IR names: it
proves the schedule first (:func:`towers.schedule.simulate`, so a wrong schedule
never reaches a device), then runs tick by tick over ``slots[tower][chunk]``:
every step's source slot is sent with ``send(..., tick=t, chunk=c)`` first (a
tick reads its slots as they were when it began), then each destination writes:
``copy`` replaces its slot, ``reduce`` computes ``combine(received, own)`` (into
an empty slot: the received value). A slot is finished (``mean`` divides)
exactly once, on the tower where its last contribution is added; copies carry
the finished value, so every output is bitwise the same. Slots complete from the
start (``n = 1``) are finished at the end.

:func:`run_schedule` all-reduces with it: every tower's value is cut into
``schedule.chunks`` equal pieces with :func:`~towers.allreduce.machinery.primitives.pad_split`
(zero padding at the end, the rule :mod:`towers.schedule.ir` counts bytes with)
and put back together with :func:`~towers.allreduce.machinery.primitives.unsplit`. The
public reduce-scatter, all-gather and broadcast
(:mod:`towers.allreduce.hand_collectives`) cut by the sharding rule instead.

Example:
    >>> outs = run_schedule(ring_schedule(3), values, op="mean")   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from towers.allreduce.machinery.base import AllReduce, check_values, combine, finish
from towers.allreduce.machinery.primitives import pad_split, send, unsplit
from towers.allreduce.machinery.registry import Configured
from towers.schedule.ir import Schedule
from towers.schedule.symbolic import simulate

__all__ = ["Scheduled", "Slots", "generator_of", "run_schedule", "run_slots", "scheduled"]

Slots = list[list[tf.Tensor | None]]
"""``slots[tower][chunk]``: the piece a tower holds of each chunk (None: none yet)."""


def run_slots(schedule: Schedule, slots: Slots, devices: Sequence[str], op: str = "sum",
              *, note: str = "") -> Slots:
    """Follow ``schedule`` over ``slots[tower][chunk]`` (None: empty) on ``devices``.

    The one interpreter of :mod:`towers.schedule.ir` for every collective: the
    all-reduce (:func:`run_schedule`) and the public reduce-scatter, all-gather and
    broadcast (:mod:`towers.allreduce.hand_collectives`) only cut the slots and put
    the results together. A reducing schedule's slot starts as its tower's own
    contribution; an all-gather's or broadcast's slot starts complete.

    Args:
        schedule: a schedule for ``len(devices)`` towers, proved before anything runs.
        slots: the starting pieces, each on its tower's device; replaced in place.
        devices: one device per tower.
        op: how ``reduce`` steps combine (``sum``, ``mean``, ``max``, ``min``).
        note: recorded before each step's kind (``"reduce_scatter"`` → ``"reduce_scatter
            reduce"``).

    Returns:
        ``slots`` after the last tick; every complete reduced slot is finished once.

    Raises:
        towers.schedule.ScheduleError: the schedule breaks a rule of the checker.
    """
    simulate(schedule)
    n, full = schedule.towers, (1 << schedule.towers) - 1
    reducing = schedule.collective in ("all_reduce", "reduce_scatter")
    have = [[(1 << t if reducing else full) if x is not None else 0 for x in row]
            for t, row in enumerate(slots)]
    done = [[not reducing and x is not None for x in row] for row in slots]
    for t, tick in enumerate(schedule.ticks):
        moved = [send(slots[s.src][s.chunk], devices[s.dst], tick=t, chunk=s.chunk,
                      note=f"{note} {s.kind}".strip()) for s in tick]
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
    for tower, row in enumerate(slots):  # complete from the start (n = 1): nothing reduced it
        with tf.device(devices[tower]):
            for c, x in enumerate(row):
                if x is not None and have[tower][c] == full and not done[tower][c]:
                    row[c] = finish(x, op, n)
    return slots


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
        ValueError: bad values, a shape that is not fully defined, a schedule for another
            tower count or collective, or a schedule the symbolic checker rejects
            (:class:`towers.schedule.ScheduleError`).
    """
    devices = check_values(values, op)
    n = len(values)
    if schedule.towers != n or schedule.collective != "all_reduce":
        raise ValueError(f"{schedule.name}: an {schedule.collective} schedule for "
                         f"{schedule.towers} towers cannot all-reduce {n} values")
    if not values[0].shape.is_fully_defined():
        raise ValueError(f"{schedule.name} needs a fully defined static shape, "
                         f"got {values[0].shape}")
    split = [pad_split(v, schedule.chunks) for v in values]
    _, shape, size = split[0]
    slots = run_slots(schedule, [list(pieces) for pieces, _, _ in split], devices, op)
    outputs = []
    for row, device in zip(slots, devices):
        with tf.device(device):
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
    :class:`~towers.allreduce.machinery.registry.Configured` running one), else None."""
    fn = getattr(fn, "run", fn) if isinstance(fn, Configured) else fn
    return fn.generator if isinstance(fn, Scheduled) else None
