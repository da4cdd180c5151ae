"""Bruck all-reduce: dissemination reduce-scatter and all-gather, partners 2^k apart, any n.

Written as data: :func:`bruck_schedule` builds the :class:`~towers.schedule.Schedule`
and :func:`~towers.allreduce.machinery.scheduled.run_schedule` runs it; its record's bytes and
depth are counted from that same object. n = 5 towers, chunks c0..c4,
``+▶t`` reduces into tower t, ``▶t`` copies to it::

    tick           0       1       2 │      3       4       5
                   reduce-scatter    │     all-gather (copy)
    tower 0    c4+▶4 c2c3+▶2   c1+▶1 │  c0 ▶4 c0c1 ▶3   c0 ▶1
    tower 1    c0+▶0 c3c4+▶3   c2+▶2 │  c1 ▶0 c1c2 ▶4   c1 ▶2
    tower 2    c1+▶1 c0c4+▶4   c3+▶3 │  c2 ▶1 c2c3 ▶0   c2 ▶3
    tower 3    c2+▶2 c0c1+▶0   c4+▶4 │  c3 ▶2 c3c4 ▶1   c3 ▶4
    tower 4    c3+▶3 c1c2+▶1   c0+▶0 │  c4 ▶3 c0c4 ▶2   c4 ▶0
                     tower r now owns c_r, finished

Index formula (K = ⌈log2 n⌉ steps, step k = 0..K-1, ``d = 2^k``): all-gather step
k is Bruck's concatenation step: tower r copies the chunks it has gathered so far,
``r + i`` for ``i < min(d, n − d)``, to tower ``r − d`` (all mod n); after K steps
tower r holds ``r, r+1, …, r+n−1``: everything. Seen per chunk, chunk c reaches
tower ``c − j`` (offset j = 1..n−1) at the step of j's *highest* bit, from the tower
at offset ``j − 2^k``: a binomial tree shifted to start at c. The reduce-scatter is
that pattern transposed and run backwards (steps K-1..0, every arrow reversed,
copies become reductions): the tower at offset j adds its partial of c into the one
at ``j − 2^k`` once all its own subtree has arrived, so after K ticks tower c owns
chunk c summed from every tower.

Non-powers of two need no padding of the tower count and no extra ticks: the last
step just carries ``n − 2^(K−1)`` chunks instead of ``2^(K−1)`` (n = 5: 1, 2, 1 —
the drawing above), which is Bruck's point. ``towers.schedule.check_schedule``
proves the pattern for every n up to 64.

Padding: the buffer is cut into n chunks of ⌈L/n⌉ elements. Cost (S bytes, a
tower sends ``n − 1`` chunks in each phase):
``2⌈log2 n⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``: the ring's bytes with logarithmic
latency. Summation depth ⌈log2 n⌉.

References:
    J. Bruck, C.-T. Ho, S. Kipnis, E. Upfal, D. Weathersby, "Efficient algorithms
    for all-to-all communications in multiport message-passing systems", IEEE TPDS
    8(11), 1997 (the concatenation algorithm; its transpose is the reduce-scatter).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from towers.allreduce.machinery.base import AllReduce
from towers.allreduce.machinery.registry import (
    Algorithm,
    Coefficients,
    Configured,
    from_schedule,
    register,
    schedule_of,
)
from towers.allreduce.machinery.scheduled import scheduled
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule, Step

__all__ = [
    "BRUCK",
    "bruck",
    "bruck_schedule",
    "cost",
    "gather_ticks",
    "steps_of",
    "transpose",
]

Tick = tuple[Step, ...]


def _tower_count(n: object) -> int:
    return positive_int("n", n)


def gather_ticks(
    n: int, dims: Sequence[int], hop: Callable[[int], int], batch: int | None = None
) -> list[Tick]:
    """All-gather ticks of shifted binomial trees: chunk c reaches tower ``c − j`` (mod n)
    at dimension ``k = hop(j)``, copied from the tower at offset ``j − 2^k``.

    Args:
        n: tower count; chunk c starts complete on tower c.
        dims: the dimensions in the order they run (each one tick, or more, see batch).
        hop: offset ``j`` (1..n-1) -> the dimension it is reached in, one of j's set bits.
        batch: at most this many chunks per tower per tick (None: a dimension is one tick).

    Returns:
        The ticks; every tower sends in every tick the same number of chunks.

    Example:
        >>> [len(t) for t in gather_ticks(5, [0, 1, 2], lambda j: j.bit_length() - 1)]
        [5, 10, 5]
    """
    ticks: list[Tick] = []
    for k in dims:
        offsets = [j for j in range(1, n) if hop(j) == k]
        size = len(offsets) if batch is None else batch
        for start in range(0, len(offsets), max(size, 1)):
            group = offsets[start : start + size]
            steps = [Step((c - j + (1 << k)) % n, (c - j) % n, c, "copy")
                     for j in group for c in range(n)]
            ticks.append(tuple(sorted(steps, key=lambda s: (s.src, (s.chunk - s.src) % n))))
    return ticks


def transpose(ticks: Sequence[Tick]) -> list[Tick]:
    """The reduce-scatter of an all-gather: ticks backwards, arrows reversed, copies → reduces.

    Every tower forwards a chunk only after all the towers its copy would have
    reached have added theirs into it (they received it later in the all-gather).

    Example:
        >>> transpose([(Step(0, 1, 0, "copy"),)])
        [(Step(src=1, dst=0, chunk=0, kind='reduce'),)]
    """
    return [tuple(Step(s.dst, s.src, s.chunk, "reduce") for s in tick) for tick in reversed(ticks)]


def steps_of(n: int) -> int:
    """⌈log2 n⌉: Bruck's step count per phase (0 for one tower)."""
    return (n - 1).bit_length()


@functools.lru_cache(maxsize=128)
def bruck_schedule(n: int) -> Schedule:
    """Bruck's reduce-scatter then all-gather over ``n`` towers, ``2⌈log2 n⌉`` ticks.

    Raises:
        ValueError: ``n`` is not an int >= 1.

    Example:
        >>> bruck_schedule(4).num_ticks, bruck_schedule(5).num_ticks
        (4, 6)
    """
    n = _tower_count(n)
    gather = gather_ticks(n, range(steps_of(n)), lambda j: j.bit_length() - 1)
    return Schedule("bruck", n, n, tuple(transpose(gather) + gather))


def _build() -> AllReduce:
    return scheduled(bruck_schedule)


def bruck() -> Configured:
    """Build the Bruck all-reduce (any tower count; see the module docstring).

    Returns:
        The configured algorithm ``(values, *, op="sum") -> list[tf.Tensor]``; its
        ``bytes_sent`` and ``summation_depth``, counted from the schedule, are
        ``2(n−1)·⌈L/n⌉·itemsize`` per tower and ``⌈log2 n⌉``.

    Example:
        >>> outs = bruck()(values, op="mean")   # doctest: +SKIP
    """
    return BRUCK()


def cost(n: int, nbytes: float) -> Coefficients:
    """α-β-γ coefficients: ``2⌈log2 n⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``.

    Example:
        >>> cost(4, 1000.0)
        (4, 1500.0, 750.0)
    """
    return 2 * steps_of(n), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


BRUCK = register(
    Algorithm("bruck", _build, schedule=schedule_of(__doc__),
              **from_schedule(bruck_schedule, cost=cost))
)
