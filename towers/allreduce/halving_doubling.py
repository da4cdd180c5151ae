"""Rabenseifner's all-reduce: reduce-scatter by recursive halving, all-gather by recursive doubling.

With p = 2^⌊log2 n⌋ active towers and r = n − p extra ones, n = 6 (p = 4, r = 2), the
buffer zero-padded to p chunks c0..c3 (``+▶t`` reduces into tower t, ``▶t`` copies to it)::

    tick:    0 fold-in      1 halve d=2  2 halve d=1  3 double d=1  4 double d=2  5 fold-out
    tower 0                 c2c3+▶2      c1+▶1        c0▶1          c0c1▶2        c0c1c2c3▶4
    tower 1                 c2c3+▶3      c0+▶0        c1▶0          c0c1▶3        c0c1c2c3▶5
    tower 2                 c0c1+▶0      c3+▶3        c2▶3          c2c3▶0
    tower 3                 c0c1+▶1      c2+▶2        c3▶2          c2c3▶1
    tower 4  c0c1c2c3+▶0    (sits out)
    tower 5  c0c1c2c3+▶1    (sits out)

Index formula (towers i < p; h = log2 p): halving step k = 0..h−1 has distance
d = p / 2^(k+1) and partner i XOR d; tower i keeps the d chunks from i − i mod d (the
half holding chunk i) and sends the other d. Doubling runs d = 1, 2, …, p/2, sending
the d chunks held to i XOR d. Extra tower p + j folds into tower j first and gets the
result from it last. L is zero-padded to p·⌈L/p⌉.

Cost (S bytes; f = 1 when r > 0 else 0):
(2·log2 p + 2f)·α + (2(p−1)/p + 2f)·Sβ + ((p−1)/p + f)·Sγ. Summation depth ⌈log2 n⌉.

References:
    Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
    Operations in MPICH", IJHPCA 19(1), 2005; Rabenseifner, "Optimization of
    Collective Reduction Operations", ICCS 2004.
"""

from __future__ import annotations

import functools

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.schedule.collectives import doubling_all_gather, fold, folded, halving_reduce_scatter
from towers.schedule.ir import Schedule

__all__ = ["cost", "halving_doubling", "halving_doubling_schedule"]


@functools.lru_cache(maxsize=128)
def halving_doubling_schedule(n: int) -> Schedule:
    """Rabenseifner's all-reduce over ``n`` towers as a schedule (fold in/out beyond p)."""
    p = fold(n)[0]
    core = halving_reduce_scatter(p).ticks + doubling_all_gather(p).ticks
    return folded("halving_doubling", n, core)


def cost(n: int, nbytes: float) -> Coefficients:
    """α-β-γ coefficients (the module's formula)."""
    h = n.bit_length() - 1
    p = 1 << h
    a, b, c = 2 * h, 2 * (p - 1) / p * nbytes, (p - 1) / p * nbytes
    if n > p:  # fold in (send S, partner adds) and fold out (receive S)
        a, b, c = a + 2, b + 2 * nbytes, c + nbytes
    return a, b, c


halving_doubling = register_schedule("halving_doubling", halving_doubling_schedule, cost, __doc__)
