"""The collectives' registry: one frozen record per (collective, algorithm), beside ``ALGORITHMS``.

A :class:`~towers.allreduce.machinery.registry.Record` (the shape every registry shares,
``kind`` the collective) holds what tools need to know about one way of running a
reduce-scatter, all-gather or broadcast: its schedule generator (from
:mod:`towers.schedule.collectives`; broadcasts are built from root 0), the ticks
in closed form, and, derived from the schedule itself
(:func:`~towers.allreduce.machinery.registry.from_schedule`), the summation depth, the exact
bytes each tower sends and the α-β-γ cost.

Registered (``COLLECTIVE_ALGORITHMS[(collective, name)]``)::

    collective       name      ticks                       depth
    reduce_scatter   ring      n - 1                       n - 1
    reduce_scatter   halving   log2 m + 2·[n ≠ m]          log2 m + [n ≠ m]
    all_gather       ring      n - 1                       0
    all_gather       doubling  log2 m + 2·[n ≠ m]          0
    broadcast        flat      1 (n > 1)                   0
    broadcast        tree      ⌈log2 n⌉                    0
    broadcast        chain     chunks + n - 2 (n > 1)      0

(``m``: the largest power of two ≤ ``n``.) Bytes follow the public sharding
rule: a buffer of ``L`` elements is cut with
:func:`~towers.schedule.collectives.even_sizes` into ``schedule.chunks`` runs
(no padding), and a step moves its run's elements. :func:`format_collective`
draws a schedule with its numbers (what ``towers trace`` shows for all-reduces).

Example:
    >>> COLLECTIVE_ALGORITHMS[("reduce_scatter", "ring")].bytes_sent(4, 40, 4)
    [28, 28, 32, 32]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from towers.allreduce.machinery.registry import Record, Registry, from_schedule
from towers.schedule import collectives as sc
from towers.schedule.ir import Schedule, cost, format_schedule

__all__ = [
    "COLLECTIVE_ALGORITHMS",
    "collective_algorithm",
    "format_collective",
    "schedule_bytes",
]

PUBLIC = ("reduce_scatter", "all_gather", "broadcast")


def schedule_bytes(schedule: Schedule, nbytes: int, itemsize: int) -> list[int]:
    """Exact bytes each tower sends when ``nbytes`` are cut by ``even_sizes`` into the chunks.

    Raises:
        ValueError: ``nbytes`` not a non-negative multiple of ``itemsize``.

    Example:
        >>> schedule_bytes(sc.ring_all_gather(3), 12, 4)   # runs of 1, 1, 1 elements
        [8, 8, 8]
    """
    if itemsize < 1 or nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"nbytes must be a multiple of itemsize; got {nbytes}, {itemsize}")
    sizes = sc.even_sizes(nbytes // itemsize, schedule.chunks)
    sent: Counter[int] = Counter()
    for _, step in schedule.steps():
        sent[step.src] += sizes[step.chunk] * itemsize
    return [sent[tower] for tower in range(schedule.towers)]


def _log2(n: int) -> int:
    return sc.fold(n)[0].bit_length() - 1


def _folded_ticks(n: int) -> int:
    return _log2(n) + 2 * (sc.fold(n)[1] > 0)


def _chain_ticks(n: int, chunks: int = 4) -> int:
    return chunks + n - 2 if n > 1 else 0


def _record(collective: str, name: str, generator: Callable[..., Schedule],
            ticks: Callable[..., int], summary: str) -> Record:
    """A collective's :class:`~towers.allreduce.machinery.registry.Record`: bytes (by the sharding
    rule), summation depth and cost derived from ``generator``; ``ticks`` in closed form."""
    return Record(name, generator, kind=collective, summary=summary, ticks=ticks,
                  **from_schedule(generator, schedule_bytes))


COLLECTIVE_ALGORITHMS = Registry(PUBLIC, [
    _record("reduce_scatter", "ring", sc.ring_reduce_scatter, lambda n: n - 1,
            "the ring's first half: n-1 ticks"),
    _record("reduce_scatter", "halving", sc.halving_reduce_scatter, _folded_ticks,
            "recursive halving: log2 n ticks (+2 off powers of two)"),
    _record("all_gather", "ring", sc.ring_all_gather, lambda n: n - 1,
            "the ring's second half: n-1 ticks"),
    _record("all_gather", "doubling", sc.doubling_all_gather, _folded_ticks,
            "recursive doubling: log2 n ticks (+2 off powers of two)"),
    _record("broadcast", "flat", sc.flat_broadcast, lambda n: int(n > 1),
            "flat: 1 tick, the root sends to every tower"),
    _record("broadcast", "tree", sc.binomial_broadcast, lambda n: (n - 1).bit_length(),
            "binomial tree: ceil(log2 n) ticks, whole value per send"),
    _record("broadcast", "chain", sc.chain_broadcast, _chain_ticks,
            "pipelined chain: chunks+n-2 ticks, 1/chunks per send"),
], by_kind=True)
"""``(collective, name) -> Record`` for every public collective's algorithms."""


def collective_algorithm(collective: str, name: str) -> Record:
    """The record for ``name`` running ``collective``, or an error listing what exists.

    Raises:
        ValueError: an unknown collective or algorithm (the message names the choices).

    Example:
        >>> collective_algorithm("broadcast", "tree").ticks(5)
        3
    """
    if collective not in PUBLIC:
        raise ValueError(f"collective must be one of {', '.join(PUBLIC)}; got {collective!r}")
    if (collective, name) not in COLLECTIVE_ALGORITHMS:
        names = sorted(a for c, a in COLLECTIVE_ALGORITHMS if c == collective)
        raise ValueError(f"algorithm must be one of {', '.join(names)} for {collective} "
                         f"(or a schedule generator n -> Schedule); got {name!r}")
    return COLLECTIVE_ALGORITHMS[(collective, name)]


def format_collective(collective: str, name: str, n: int, nbytes: int = 4096,
                      itemsize: int = 4, **params: Any) -> str:
    """One collective's schedule drawn (towers × ticks) with its ticks, depth, bytes and cost.

    Example:
        >>> print(format_collective("broadcast", "tree", 3, nbytes=8))   # doctest: +SKIP
        broadcast/tree on 3 towers: 2 ticks, summation depth 0
        ...
    """
    record = collective_algorithm(collective, name)
    assert record.generator is not None and record.summation_depth is not None
    schedule = record.generator(n, **params)
    a, b, c = cost(schedule, float(nbytes))
    return "\n".join([
        f"{collective}/{name} on {n} towers: {schedule.num_ticks} ticks, summation depth "
        f"{record.summation_depth(n)}  ({record.summary})",
        format_schedule(schedule),
        f"bytes sent per tower for {nbytes} bytes: {schedule_bytes(schedule, nbytes, itemsize)}",
        f"cost: {a}·α + {b:g}·β + {c:g}·γ",
    ])
