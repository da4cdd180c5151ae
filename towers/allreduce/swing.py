"""Swing all-reduce: recursive halving and doubling with peers that swing left and right.

p = 4 towers, chunks c0..c3, ``+▶t`` reduces into tower t, ``▶t`` copies to it::

    tick          0        1    │     2        3
                  reduce-scatter │     all-gather (copy)
    tower 0   c1c2+▶1    c3+▶3  │   c0 ▶3  c0c3 ▶1
    tower 1   c0c3+▶0    c2+▶2  │   c1 ▶2  c1c2 ▶0
    tower 2   c0c3+▶3    c1+▶1  │   c2 ▶1  c1c2 ▶3
    tower 3   c1c2+▶2    c0+▶0  │   c3 ▶0  c0c3 ▶2
                       tower r now owns c_r, finished

Index formula (p = 2^k towers, step s = 0..k-1): tower r's peer is
``ρ(r, s) = r + δ(s)`` for even r and ``r − δ(s)`` for odd r (mod p), with
``δ(s) = (1 − (−2)^(s+1)) / 3 = 1, −1, 3, −5, 11, …``. Let ``R(x, s)`` be the towers x
reaches through steps s..k-1 (``R(x, k) = {x}``, ``R(x, s) = R(x, s+1) ∪ R(ρ(x, s), s+1)``).
Reduce-scatter step s: r reduces the chunks ``R(ρ(r, s), s+1)`` into its peer; all-gather
runs the steps backwards, r copying ``R(r, s+1)`` to ``ρ(r, s)``. Against recursive
halving's ``r XOR 2^s``, a peer is at distance ``|δ(s)| < 2^s`` on a ring or torus.
Other n fold in and out as :mod:`~towers.allreduce.halving_doubling` does (not the paper's
extension). Cost (S bytes, chunks of ⌈L/p⌉ elements; f = 1 when n > p else 0), Rabenseifner's:
``(2·log2 p + 2f)·α + (2(p−1)/p + 2f)·S·β + ((p−1)/p + f)·S·γ``; summation depth ⌈log2 n⌉.

References:
    D. De Sensi, T. Bonato, D. Saam, T. Hoefler, "Swing: Short-cutting Rings for
    Higher Bandwidth Allreduce", NSDI 2024 (arXiv:2401.09356).
"""

from __future__ import annotations

import functools

from towers.allreduce.halving_doubling import cost
from towers.allreduce.machinery.registry import register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.collectives import fold, folded
from towers.schedule.ir import Schedule, Step

__all__ = ["cost", "peer", "swing", "swing_schedule"]


def peer(rank: int, step: int, p: int) -> int:
    """Swing's ``ρ(r, s)`` among ``p`` towers: ``r ± δ(s) mod p`` (+ for even r)."""
    d = (1 - (-2) ** (step + 1)) // 3  # δ(s) = 1, -1, 3, -5, 11, …
    return (rank + d) % p if rank % 2 == 0 else (rank - d) % p


@functools.lru_cache(maxsize=128)
def swing_schedule(n: int) -> Schedule:
    """Swing's all-reduce over ``n`` towers as a schedule (fold in/out beyond 2^⌊log2 n⌋)."""
    p = fold(positive_int("n", n))[0]
    k = p.bit_length() - 1
    reach = [[frozenset([x]) for x in range(p)]]  # reach[s][x]: whom x reaches in steps s..k-1
    for s in reversed(range(k)):
        reach.insert(0, [reach[0][x] | reach[0][peer(x, s, p)] for x in range(p)])
    ticks: list[tuple[Step, ...]] = []
    for s in range(k):  # reduce-scatter: hand the peer the half it will own
        ticks.append(tuple(Step(r, peer(r, s, p), c, "reduce")
                           for r in range(p) for c in sorted(reach[s + 1][peer(r, s, p)])))
    for s in reversed(range(k)):  # all-gather: the same steps backwards, copying
        ticks.append(tuple(Step(r, peer(r, s, p), c, "copy")
                           for r in range(p) for c in sorted(reach[s + 1][r])))
    return folded("swing", n, ticks)


swing = register_schedule("swing", swing_schedule, cost, __doc__)
