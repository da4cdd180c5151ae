"""Ring all-reduce: reduce-scatter then all-gather around a ring of towers.

Each value is flattened, zero-padded and cut into ``n·s`` chunks (``s`` sub-chunks). In
``n-1`` reduce-scatter ticks every tower sends one chunk's partial to its right-hand
neighbour, which adds its own copy; tower ``k`` then finishes chunk ``k`` and ``n-1``
all-gather ticks copy the finished chunks round the ring. n = 4, s = 1 (``cK`` = chunk K)::

    tick       0        1        2     │    3        4        5
               reduce-scatter (+ own)  │    all-gather (copy)
    tower 0   c3 ─▶1   c2 ─▶1   c1 ─▶1 │   c0 ─▶1   c3 ─▶1   c2 ─▶1
    tower 1   c0 ─▶2   c3 ─▶2   c2 ─▶2 │   c1 ─▶2   c0 ─▶2   c3 ─▶2
    tower 2   c1 ─▶3   c0 ─▶3   c3 ─▶3 │   c2 ─▶3   c1 ─▶3   c0 ─▶3
    tower 3   c2 ─▶0   c1 ─▶0   c0 ─▶0 │   c3 ─▶0   c2 ─▶0   c1 ─▶0
                             tower k now owns c_k, finished

Index formula (ring position ``p``, tick ``t = 0 .. n-2``): the reduce-scatter sends chunk
``(p - 1 - t) mod n`` to ``p + 1``, the all-gather chunk ``(p - t) mod n``. Chunk ``k``'s
sum is ``x_{k+1} ⊕ x_{k+2} ⊕ … ⊕ x_k``: a different order per chunk. Sub-chunks (as TF's
``build_ring_all_reduce``): chunk ``g·s + r`` is segment ``g`` of ring ``r``, whose towers
are rotated by ``r·max(1, n // s)`` positions, so each ring finishes on other towers.

Cost (n towers, S bytes, padding aside): ``2(n-1)s·α + 2(n-1)/n·S·β + (n-1)/n·S·γ``,
bandwidth-optimal; summation depth ``n-1``. Schedule :func:`towers.schedule.ring_schedule`.

References:
    P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters
    of workstations", J. Parallel Distrib. Comput. 69(2), 2009. TensorFlow
    ``distribute/v1/all_reduce.py`` (``_build_ring_gather``, ``_build_ring_scatter``).
"""

from __future__ import annotations

from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.collectives import ring_schedule

__all__ = ["cost", "ring"]


def cost(n: int, nbytes: float, *, subchunks: int = 1) -> Coefficients:
    """α-β-γ coefficients of the module docstring (one α per ring's message)."""
    subchunks = positive_int("subchunks", subchunks)
    return 2 * (n - 1) * subchunks, 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


ring = register_schedule("ring", ring_schedule, cost, __doc__)
