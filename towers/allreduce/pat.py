"""PAT all-reduce: NCCL's Parallel Aggregated Trees reduce-scatter and all-gather, composed.

n = 5 towers, chunks c0..c4, ``+▶t`` reduces into tower t, ``▶t`` copies to it::

    tick           0       1       2 │      3       4       5
                   reduce-scatter    │     all-gather (copy)
    tower 0  c1c3+▶1   c2+▶2   c4+▶4 │  c0 ▶1   c0 ▶3 c0c2 ▶4
    tower 1  c2c4+▶2   c3+▶3   c0+▶0 │  c1 ▶2   c1 ▶4 c1c3 ▶0
    tower 2  c0c3+▶3   c4+▶4   c1+▶1 │  c2 ▶3   c2 ▶0 c2c4 ▶1
    tower 3  c1c4+▶4   c0+▶0   c2+▶2 │  c3 ▶4   c3 ▶1 c0c3 ▶2
    tower 4  c0c2+▶0   c1+▶1   c3+▶3 │  c4 ▶0   c4 ▶2 c1c4 ▶3
                      tower r now owns c_r, finished

Index formula (K = ⌈log2 n⌉ dimensions): Bruck's algorithm (:mod:`towers.allreduce.bruck`)
with the dimensions reversed: chunk c reaches tower ``c − j`` at the dimension of j's
*lowest* set bit ``k``, from offset ``j − 2^k``; the all-gather runs k = K−1 down to 0, so
the far hops carry little data. The reduce-scatter is its transpose, run backwards.

``pat(aggregation=A)`` bounds the staging buffer as NCCL does: at most A chunks per
tower per tick, a dimension split over ⌈m/A⌉ ticks (None: a dimension per tick).

Cost (S bytes in n chunks, ``m_k`` chunks in dimension k: :func:`chunks_per_dimension`):
``2·Σ_k ⌈m_k/A⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``. Summation depth ⌈log2 n⌉.

References:
    S. Jeaugey, "PAT: a new algorithm for all-gather and reduce-scatter operations
    at scale", arXiv:2506.20252, 2025; NVIDIA, "New Scaling Algorithm and
    Initialization with NCCL 2.23" (developer blog, 2024); NVIDIA/nccl #1473, #1594.
"""

from __future__ import annotations

import functools
import math

from towers.allreduce.bruck import gather_ticks, steps_of, transpose
from towers.allreduce.machinery.registry import Coefficients, register_schedule
from towers.guard.arguments import positive_int
from towers.schedule.ir import Schedule

__all__ = ["chunks_per_dimension", "cost", "pat", "pat_schedule"]


def chunks_per_dimension(n: int) -> list[int]:
    """``m_k``: the chunks a tower sends in dimension k (offsets whose lowest set bit is k)."""
    return [(n - 1 - (1 << k)) // (1 << (k + 1)) + 1 for k in range(steps_of(n))]


@functools.lru_cache(maxsize=256)
def pat_schedule(n: int, aggregation: int | None = None) -> Schedule:
    """PAT's reduce-scatter then all-gather over ``n`` towers, at most ``aggregation`` chunks
    per tower per tick (None: unbounded)."""
    n = positive_int("n", n)
    batch = None if aggregation is None else positive_int("aggregation", aggregation)
    gather = gather_ticks(n, range(steps_of(n) - 1, -1, -1),
                          lambda j: (j & -j).bit_length() - 1, batch)  # j's lowest set bit
    return Schedule("pat", n, n, tuple(transpose(gather) + gather))


def cost(n: int, nbytes: float, aggregation: int | None = None) -> Coefficients:
    """α-β-γ coefficients (the module's formula)."""
    batch = None if aggregation is None else positive_int("aggregation", aggregation)
    per = chunks_per_dimension(n)
    ticks = len(per) if batch is None else sum(math.ceil(m / batch) for m in per)
    return 2 * ticks, 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


pat = register_schedule("pat", pat_schedule, cost, __doc__)
