"""Bruck all-reduce: dissemination reduce-scatter and all-gather, partners 2^k apart, any n.

n = 5 towers, chunks c0..c4, ``+▶t`` reduces into tower t, ``▶t`` copies to it::

    tick           0       1       2 │      3       4       5
                   reduce-scatter    │     all-gather (copy)
    tower 0    c4+▶4 c2c3+▶2   c1+▶1 │  c0 ▶4 c0c1 ▶3   c0 ▶1
    tower 1    c0+▶0 c3c4+▶3   c2+▶2 │  c1 ▶0 c1c2 ▶4   c1 ▶2
    tower 2    c1+▶1 c0c4+▶4   c3+▶3 │  c2 ▶1 c2c3 ▶0   c2 ▶3
    tower 3    c2+▶2 c0c1+▶0   c4+▶4 │  c3 ▶2 c3c4 ▶1   c3 ▶4
    tower 4    c3+▶3 c1c2+▶1   c0+▶0 │  c4 ▶3 c0c4 ▶2   c4 ▶0
                     tower r now owns c_r, finished

Index formula (K = ⌈log2 n⌉ steps, ``d = 2^k``): all-gather step k copies the chunks
tower r has gathered so far, ``r + i`` for ``i < min(d, n − d)``, to tower ``r − d``
(mod n): chunk c reaches tower ``c − j`` at the step of j's *highest* bit. The
reduce-scatter is that pattern transposed and run backwards (:func:`transpose`).

Cost (S bytes): ``2⌈log2 n⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``, the ring's bytes with
logarithmic latency. Summation depth ⌈log2 n⌉.

References:
    J. Bruck, C.-T. Ho, S. Kipnis, E. Upfal, D. Weathersby, "Efficient algorithms
    for all-to-all communications in multiport message-passing systems", IEEE TPDS
    8(11), 1997 (the concatenation algorithm; its transpose is the reduce-scatter).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule, Step

__all__ = ["bruck", "bruck_schedule", "cost", "gather_ticks", "steps_of", "transpose"]

Tick = tuple[Step, ...]


def gather_ticks(
    n: int, dims: Sequence[int], hop: Callable[[int], int], batch: int | None = None
) -> list[Tick]:
    """All-gather ticks of shifted binomial trees: chunk c reaches tower ``c − j`` (mod n)
    at dimension ``k = hop(j)``, copied from offset ``j − 2^k``; dimensions run in ``dims``
    order, at most ``batch`` chunks per tower per tick (None: one tick per dimension)."""
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
    """The reduce-scatter of an all-gather: ticks backwards, arrows reversed, copies → reduces."""
    return [tuple(Step(s.dst, s.src, s.chunk, "reduce") for s in tick) for tick in reversed(ticks)]


def steps_of(n: int) -> int:
    """⌈log2 n⌉: Bruck's step count per phase (0 for one tower)."""
    return (n - 1).bit_length()


@functools.lru_cache(maxsize=128)
def bruck_schedule(n: int) -> Schedule:
    """Bruck's reduce-scatter then all-gather over ``n`` towers, ``2⌈log2 n⌉`` ticks."""
    n = positive_int("n", n)
    gather = gather_ticks(n, range(steps_of(n)), lambda j: j.bit_length() - 1)
    return Schedule("bruck", n, n, tuple(transpose(gather) + gather))


def cost(n: int, nbytes: float) -> Coefficients:
    """α-β-γ coefficients (the module's formula)."""
    return 2 * steps_of(n), 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


bruck = register_schedule("bruck", bruck_schedule, cost, __doc__)
