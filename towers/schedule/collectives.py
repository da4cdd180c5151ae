"""The ring all-reduce, and reduce-scatter, all-gather and broadcast, as data: ``n -> Schedule``.

Chunk ``c`` of a reduce-scatter or all-gather is tower ``c``'s shard; a broadcast cuts the
value into ``chunks`` pieces, all the root's (root 0; :func:`rooted` turns the labels). The
ring (drawn in :mod:`towers.allreduce.ring`) is a reduce-scatter then an all-gather;
recursive halving and doubling are drawn in :mod:`towers.allreduce.halving_doubling`.

Broadcast, root 0, n = 5: flat (the root sends to every tower in one tick, not
drawn), binomial tree (a tower forwards in the tick after it receives;
``⌈log2 n⌉`` ticks) and pipelined chain with 3 chunks (tower p forwards chunk
t-p at tick t; ``chunks + n - 2`` ticks)::

    tree     0     1     2              chain    0     1     2     3     4
    tower 0  c0▶1  c0▶2  c0▶4           tower 0  c0▶1  c1▶1  c2▶1
    tower 1        c0▶3                 tower 1        c0▶2  c1▶2  c2▶2
                                        tower 2              c0▶3  c1▶3  c2▶3
                                        tower 3                    c0▶4  c1▶4 ...

Cost (``S`` bytes, α-β-γ): ring reduce-scatter/all-gather ``(n-1)α + (n-1)/n·Sβ``
(+ ``(n-1)/n·Sγ`` reducing); halving/doubling ``log2 n·α + (n-1)/n·Sβ`` for
powers of two; flat broadcast ``α + (n-1)Sβ``; tree broadcast ``⌈log2 n⌉(α + Sβ)``;
chain ``(k+n-2)(α + S/k·β)``.

References:
    Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
    Operations in MPICH" (IJHPCA 2005): recursive halving/doubling, binomial tree.
    Patarasuk, Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations" (JPDC 2009): the ring. Träff, Ripke, "Optimal broadcast for
    fully connected processor-node networks" (2008): the pipelined chain.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence

from towers.guard.arguments import non_negative_int, positive_int
from towers.schedule.ir import Schedule, Step, chunk_bytes

__all__ = ["binomial_broadcast", "chain_broadcast", "doubling_all_gather", "even_sizes",
           "flat_broadcast", "fold", "folded", "halving_reduce_scatter", "ring_all_gather",
           "ring_orders", "ring_reduce_scatter", "ring_schedule", "rooted", "schedule_bytes"]


def _towers(n: int) -> int:
    return positive_int("n (the tower count)", n)


def even_sizes(length: int, pieces: int) -> list[int]:
    """The sharding rule: ``length`` elements cut into ``pieces`` runs differing by at most one
    (the first ``length mod pieces`` runs one longer, as ``numpy.array_split``; no padding).

    Example:
        >>> even_sizes(10, 4), even_sizes(2, 3)
        ([3, 3, 2, 2], [1, 1, 0])
    """
    non_negative_int("length", length)
    base, extra = divmod(length, positive_int("pieces", pieces))
    return [base + (i < extra) for i in range(pieces)]


def schedule_bytes(schedule: Schedule, nbytes: int, itemsize: int) -> list[int]:
    """Exact bytes each tower sends when ``nbytes`` are cut by ``even_sizes`` into the chunks."""
    chunk_bytes(schedule, nbytes, itemsize)  # the same checks of nbytes and itemsize
    sizes = even_sizes(nbytes // itemsize, schedule.chunks)
    sent: Counter[int] = Counter()
    for _, step in schedule.steps():
        sent[step.src] += sizes[step.chunk] * itemsize
    return [sent[tower] for tower in range(schedule.towers)]


def fold(n: int) -> tuple[int, int]:
    """``(m, r)``: ``m`` the largest power of two ≤ ``n``, ``r = n - m`` extra towers."""
    m = 1 << (_towers(n).bit_length() - 1)
    return m, n - m


def folded(name: str, n: int, core: Sequence[tuple[Step, ...]]) -> Schedule:
    """An all-reduce over ``n`` towers from ``core``, ticks over the ``m`` towers of
    :func:`fold`: extra tower ``m + j`` first reduces its buffer into tower ``j``, and
    gets the result back from it in a last tick."""
    m, r = fold(n)
    if not r:
        return Schedule(name, n, m, tuple(core))
    fold_in = tuple(Step(m + j, j, c, "reduce") for j in range(r) for c in range(m))
    fold_out = tuple(Step(j, m + j, c, "copy") for j in range(r) for c in range(m))
    return Schedule(name, n, m, (fold_in, *core, fold_out))


def ring_orders(n: int, subchunks: int = 1) -> list[list[int]]:
    """The ``subchunks`` rings as towers by position: ring ``r`` rotated by ``r·max(1, n//s)``
    (4, 2: ``[[0, 1, 2, 3], [2, 3, 0, 1]]``)."""
    step = max(1, n // subchunks)
    return [[(p + r * step) % n for p in range(n)] for r in range(subchunks)]


@functools.lru_cache(maxsize=256)
def ring_schedule(n: int, subchunks: int = 1) -> Schedule:
    """The ring all-reduce over ``n`` towers: ``s`` rotated rings, ``n·s`` chunks, ``2(n-1)`` ticks.

    Chunk ``g·s + r`` is segment ``g`` of ring ``r`` (``ring_orders(n, s)[r]``); it ends
    finished on that ring's position ``g``.
    """
    n, s = _towers(n), positive_int("subchunks", subchunks)
    orders = ring_orders(n, s)

    def tick(t: int, kind: str, lag: int) -> tuple[Step, ...]:
        return tuple(Step(order[p], order[(p + 1) % n], (p - lag - t) % n * s + r, kind)
                     for r, order in enumerate(orders) for p in range(n))

    scatter = [tick(t, "reduce", 1) for t in range(n - 1)]
    return Schedule("ring", n, n * s, tuple(scatter + [tick(t, "copy", 0) for t in range(n - 1)]))


def ring_reduce_scatter(n: int) -> Schedule:
    """Ring reduce-scatter: the ring's first ``n - 1`` ticks; chunk ``k`` ends on tower ``k``."""
    ticks = ring_schedule(_towers(n)).ticks[: n - 1]
    return Schedule("ring_reduce_scatter", n, n, ticks, "reduce_scatter")


def ring_all_gather(n: int) -> Schedule:
    """Ring all-gather: the ring's last ``n - 1`` ticks; tower ``k`` starts with chunk ``k``."""
    ticks = ring_schedule(_towers(n)).ticks[n - 1 :]
    return Schedule("ring_all_gather", n, n, ticks, "all_gather")


def _stands_for(n: int) -> list[list[int]]:
    """``[v]``: the chunks (towers) tower ``v < m`` stands for while the ``m`` towers work."""
    m, r = fold(n)
    return [[v, m + v] if v < r else [v] for v in range(m)]


def _distances(m: int) -> list[int]:
    return [1 << j for j in range(m.bit_length() - 1)]  # 1, 2, ..., m/2


def halving_reduce_scatter(n: int) -> Schedule:
    """Recursive halving reduce-scatter for any ``n`` (extra towers folded in first)."""
    m, r = fold(n)
    groups = _stands_for(n)
    ticks: list[tuple[Step, ...]] = []
    if r:
        ticks.append(tuple(Step(m + i, i, c, "reduce") for i in range(r) for c in range(n)))
    keeps = [list(range(m)) for _ in range(m)]  # virtual towers whose chunks v still reduces
    for d in reversed(_distances(m)):
        tick = []
        for v in range(m):
            partner = v ^ d
            sent = [w for w in keeps[v] if w & d == partner & d]
            keeps[v] = [w for w in keeps[v] if w & d == v & d]
            tick += [Step(v, partner, c, "reduce") for w in sent for c in groups[w]]
        ticks.append(tuple(tick))
    if r:
        ticks.append(tuple(Step(i, m + i, m + i, "copy") for i in range(r)))
    return Schedule("halving_reduce_scatter", n, n, tuple(ticks), "reduce_scatter")


def doubling_all_gather(n: int) -> Schedule:
    """Recursive doubling all-gather for any ``n`` (extra towers hand their chunk in first)."""
    m, r = fold(n)
    groups = _stands_for(n)
    ticks: list[tuple[Step, ...]] = []
    if r:
        ticks.append(tuple(Step(m + i, i, m + i, "copy") for i in range(r)))
    for d in _distances(m):
        ticks.append(tuple(Step(v, v ^ d, c, "copy") for v in range(m)
                           for w in range(m) if (w ^ v) < d  # v's aligned block of d towers
                           for c in groups[w]))
    if r:
        ticks.append(tuple(Step(i, m + i, c, "copy")
                           for i in range(r) for c in range(n) if c != m + i))
    return Schedule("doubling_all_gather", n, n, tuple(ticks), "all_gather")


def binomial_broadcast(n: int) -> Schedule:
    """Binomial-tree broadcast from tower 0: at tick ``j``, ``p < 2^j`` sends to ``p + 2^j``."""
    ticks, d = [], 1
    while d < _towers(n):
        ticks.append(tuple(Step(p, p + d, 0, "copy") for p in range(d) if p + d < n))
        d *= 2
    return Schedule("binomial_broadcast", n, 1, tuple(ticks), "broadcast")


def flat_broadcast(n: int) -> Schedule:
    """Flat broadcast from tower 0: one tick (one ``α``), the root sends ``(n-1)·S``."""
    steps = tuple(Step(0, p, 0, "copy") for p in range(1, _towers(n)))
    return Schedule("flat_broadcast", n, 1, (steps,) if steps else (), "broadcast")


def chain_broadcast(n: int, chunks: int = 4) -> Schedule:
    """Pipelined chain broadcast from tower 0: ``chunks`` pieces flow ``0 → 1 → … → n-1``."""
    _towers(n), positive_int("chunks", chunks)
    ticks = [tuple(Step(p, p + 1, t - p, "copy") for p in range(n - 1) if 0 <= t - p < chunks)
             for t in range(chunks + n - 2)] if n > 1 else []
    return Schedule("chain_broadcast", n, chunks, tuple(ticks), "broadcast")


def rooted(schedule: Schedule, root: int) -> Schedule:
    """``schedule`` (a broadcast) with its towers turned so the root is ``root``.

    Example:
        >>> rooted(binomial_broadcast(3), 2).ticks[0]
        (Step(src=2, dst=0, chunk=0, kind='copy'),)
    """
    n = schedule.towers
    if schedule.collective != "broadcast":
        raise ValueError(f"rooted takes a broadcast schedule, got {schedule.collective!r}")
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"root must be a tower index in [0, {n}), got {root!r}")
    shift = root - schedule.chunk_owner(0)
    ticks = tuple(tuple(Step((s.src + shift) % n, (s.dst + shift) % n, s.chunk, s.kind)
                        for s in tick) for tick in schedule.ticks)
    return Schedule(schedule.name, n, schedule.chunks, ticks, "broadcast",
                    (root,) * schedule.chunks)
