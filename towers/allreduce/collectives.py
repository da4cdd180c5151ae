"""The other collectives: reduce-scatter, all-gather, broadcast (run from schedules), all-to-all.

:func:`reduce_scatter` gives tower ``i`` run ``i`` of the flattened reduction (cut by
:func:`~towers.schedule.collectives.even_sizes`), so ``all_gather(reduce_scatter(v))`` is
the flattened all-reduce. The first three run a schedule of :data:`COLLECTIVE_ALGORITHMS`
(drawn by :func:`format_collective`) or of any generator ``n -> Schedule``.

Example:
    >>> full = all_gather(reduce_scatter(values, algorithm="halving"))   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from towers.allreduce.machinery.base import check_scale, check_values, device_of, scale
from towers.allreduce.machinery.packed import per_tower
from towers.allreduce.machinery.primitives import send
from towers.allreduce.machinery.registry import Record, Registry, from_schedule
from towers.allreduce.machinery.scheduled import Slots, run_slots
from towers.devices import canonical_device
from towers.schedule import collectives as sc
from towers.schedule.collectives import even_sizes, rooted
from towers.schedule.ir import Schedule, cost, format_schedule

__all__ = ["COLLECTIVE_ALGORITHMS", "all_gather", "all_to_all", "broadcast",
           "collective_algorithm", "format_collective", "reduce_scatter"]

PUBLIC = ("reduce_scatter", "all_gather", "broadcast")


def _record(collective: str, name: str, generator: Callable[..., Schedule],
            summary: str) -> Record:
    """A collective's record, derived from ``generator``."""
    return Record(name, generator, kind=collective, summary=summary,
                  **from_schedule(generator, sc.schedule_bytes))


COLLECTIVE_ALGORITHMS = Registry(PUBLIC, [
    _record("reduce_scatter", "ring", sc.ring_reduce_scatter, "the ring's first half: n-1 ticks"),
    _record("reduce_scatter", "halving", sc.halving_reduce_scatter,
            "recursive halving: log2 n ticks (+2 off powers of two)"),
    _record("all_gather", "ring", sc.ring_all_gather, "the ring's second half: n-1 ticks"),
    _record("all_gather", "doubling", sc.doubling_all_gather,
            "recursive doubling: log2 n ticks (+2 off powers of two)"),
    _record("broadcast", "flat", sc.flat_broadcast, "flat: 1 tick, the root sends to every tower"),
    _record("broadcast", "tree", sc.binomial_broadcast,
            "binomial tree: ceil(log2 n) ticks, whole value per send"),
    _record("broadcast", "chain", sc.chain_broadcast,
            "pipelined chain: chunks+n-2 ticks, 1/chunks per send"),
], by_kind=True)
"""``(collective, name) -> Record`` for every public collective's algorithms."""


def collective_algorithm(collective: str, name: str) -> Record:
    """The record for ``name`` running ``collective``, or an error listing what exists."""
    if collective not in PUBLIC:
        raise ValueError(f"collective must be one of {', '.join(PUBLIC)}; got {collective!r}")
    if (collective, name) not in COLLECTIVE_ALGORITHMS:
        names = sorted(a for c, a in COLLECTIVE_ALGORITHMS if c == collective)
        raise ValueError(f"algorithm must be one of {', '.join(names)} for {collective} "
                         f"(or a schedule generator n -> Schedule); got {name!r}")
    return COLLECTIVE_ALGORITHMS[(collective, name)]


def format_collective(collective: str, name: str, n: int, nbytes: int = 4096,
                      itemsize: int = 4, **params: Any) -> str:
    """One collective's schedule drawn (towers × ticks) with its ticks, depth, bytes and cost."""
    record = collective_algorithm(collective, name)
    assert record.generator is not None and record.summation_depth is not None
    schedule = record.generator(n, **params)
    a, b, c = cost(schedule, float(nbytes))
    return "\n".join([
        f"{collective}/{name} on {n} towers: {schedule.num_ticks} ticks, summation depth "
        f"{record.summation_depth(n)}  ({record.summary})",
        format_schedule(schedule),
        f"bytes sent per tower for {nbytes} bytes: "
        f"{sc.schedule_bytes(schedule, nbytes, itemsize)}",
        f"cost: {a}·α + {b:g}·β + {c:g}·γ",
    ])


Algorithm = str | Callable[[int], Schedule]


def _schedule(collective: str, algorithm: Algorithm, n: int) -> Schedule:
    """The schedule ``algorithm`` names (or generates) for ``n`` towers, checked to fit."""
    if isinstance(algorithm, str):
        schedule = collective_algorithm(collective, algorithm)(n)  # its factory: the generator
    elif callable(algorithm):
        schedule = algorithm(n)
    else:
        raise TypeError(f"algorithm must be a name or a generator n -> Schedule, "
                        f"got {algorithm!r}")
    if not isinstance(schedule, Schedule) or schedule.collective != collective:
        what = getattr(schedule, "collective", type(schedule).__name__)
        raise ValueError(f"algorithm must give a {collective} Schedule, got {what}")
    if schedule.towers != n:
        raise ValueError(f"algorithm gave a schedule for {schedule.towers} towers, not {n}")
    if collective != "broadcast" and schedule.owners != tuple(range(n)):
        raise ValueError(f"algorithm's {collective} schedule must have {n} chunks, chunk i "
                         f"owned by tower i; got owners {schedule.owners}")
    return schedule


def reduce_scatter(values: Sequence[tf.Tensor], *, algorithm: Algorithm = "ring",
                   op: str = "sum", prescale: float = 1.0,
                   postscale: float = 1.0) -> list[tf.Tensor]:
    """Reduce one value per tower (static shapes); tower ``i`` gets run ``i`` of the
    flattened reduction. ``algorithm``: ``"ring"``, ``"halving"`` or a ``reduce_scatter``
    generator; ``op``, ``prescale``, ``postscale`` as in :func:`towers.all_reduce`."""
    devices = check_values(values, op)
    pre = check_scale("prescale", prescale, values[0].dtype)
    post = check_scale("postscale", postscale, values[0].dtype)
    for i, v in enumerate(values):
        if not v.shape.is_fully_defined():
            raise ValueError(f"values[{i}] needs a static shape, got {v.shape}")
    n = len(values)
    schedule = _schedule("reduce_scatter", algorithm, n)
    sizes = even_sizes(int(values[0].shape.num_elements()), n)
    slots: Slots = per_tower(devices, lambda i: list(tf.split(
        tf.reshape(scale(values[i], pre), [-1]), sizes)))
    slots = run_slots(schedule, slots, devices, op, note="reduce_scatter")
    return [scale(slots[i][i], post) for i in range(n)]


def all_gather(shards: Sequence[tf.Tensor], *, algorithm: Algorithm = "ring") -> list[tf.Tensor]:
    """Every tower ends with ``concat(shards, axis=0)`` (copies only: bitwise equal);
    ``algorithm``: ``"ring"``, ``"doubling"`` or an ``all_gather`` generator."""
    devices, n = check_values(shards, name="shards", rows=True), len(shards)
    schedule = _schedule("all_gather", algorithm, n)
    slots: Slots = [[x if c == t else None for c in range(n)] for t, x in enumerate(shards)]
    slots = run_slots(schedule, slots, devices, note="all_gather")
    return per_tower(devices, lambda t: tf.concat(slots[t], axis=0))


def broadcast(value: tf.Tensor, devices: Sequence[str], *, root: int = 0,
              algorithm: Algorithm = "tree") -> list[tf.Tensor]:
    """Copy ``value`` (static shape, on ``devices[root]``) to every device in ``devices``;
    ``algorithm``: ``"tree"``, ``"chain"``, ``"flat"`` or a ``broadcast`` generator."""
    if not isinstance(value, (tf.Tensor, tf.Variable)):
        raise TypeError(f"value must be a tf.Tensor, got {type(value).__name__}")
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
    names = [canonical_device(d) if isinstance(d, str) else "" for d in devices]
    for i, d in enumerate(names):
        if not d:
            raise ValueError(f"devices[{i}] must be a device name, got {devices[i]!r}")
        if d in names[:i]:
            raise ValueError(f"devices[{names.index(d)}] and devices[{i}] are both {d}")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < len(names):
        raise ValueError(f"root must be an index into devices [0, {len(names)}), got {root!r}")
    if not value.shape.is_fully_defined():
        raise ValueError(f"value needs a static shape, got {value.shape}")
    if device_of(value, "value") != names[root]:  # any dtype: a broadcast only copies
        raise ValueError(f"value is on {device_of(value, 'value')}, not on devices[root={root}] "
                         f"{names[root]}: create it there (or pass that root)")
    schedule = rooted(_schedule("broadcast", algorithm, len(names)), root)
    shape, size = value.shape, int(value.shape.num_elements())
    with tf.device(names[root]):
        pieces = tf.split(tf.reshape(value, [-1]), even_sizes(size, schedule.chunks))
    slots: Slots = [list(pieces) if i == root else [None] * schedule.chunks
                    for i in range(len(names))]
    slots = run_slots(schedule, slots, names, note="broadcast")
    return per_tower(names, lambda i: value if i == root
                     else tf.reshape(tf.concat(slots[i], axis=0), shape))


def all_to_all(values: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``out[i] = concat([block i of values[j] for j], axis=0)``, each value cut along
    axis 0 into ``n`` equal blocks: a transpose of blocks, in one tick."""
    devices, n = check_values(values), len(values)
    for i, v in enumerate(values):
        if not v.shape.is_fully_defined() or v.shape.rank == 0:
            raise ValueError(f"values[{i}] needs a static shape of rank >= 1, got {v.shape}")
    if values[0].shape[0] % n:
        raise ValueError(f"values[0] has {values[0].shape[0]} rows on axis 0, not a multiple "
                         f"of the {n} towers: all_to_all cuts axis 0 into {n} equal blocks")
    blocks = per_tower(devices, lambda i: tf.split(values[i], n, axis=0))
    return per_tower(devices, lambda i: tf.concat(
        [send(blocks[j][i], devices[i], tick=0, chunk=j, note="all_to_all") for j in range(n)],
        axis=0))
