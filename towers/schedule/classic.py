"""Classic schedules as generators, ``n -> Schedule``: the ring, and the dissemination pattern.

``ring_schedule`` is :mod:`towers.allreduce.ring` (one ring, ``s = 1``) written as
data: ``n - 1`` reduce-scatter ticks in which tower ``p`` reduces chunk
``(p - 1 - t) mod n`` into ``p + 1``, then ``n - 1`` all-gather ticks in which it
copies chunk ``(p - t) mod n`` to ``p + 1``; chunk ``k`` ends complete on tower ``k``.

Example:
    >>> ring_schedule(3).num_ticks
    4
"""

from __future__ import annotations

from towers.schedule.ir import Schedule, Step

__all__ = ["ring_schedule"]


def ring_schedule(n: int) -> Schedule:
    """The ring all-reduce over ``n`` towers and ``n`` chunks (``2(n-1)`` ticks)."""
    scatter = [
        tuple(Step(p, (p + 1) % n, (p - 1 - t) % n, "reduce") for p in range(n))
        for t in range(n - 1)
    ]
    gather = [
        tuple(Step(p, (p + 1) % n, (p - t) % n, "copy") for p in range(n)) for t in range(n - 1)
    ]
    return Schedule("ring", n, n, tuple(scatter + gather))
