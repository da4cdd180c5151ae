"""Collectives as data: a TensorFlow-free schedule, its derived quantities and its proof.

``ir`` (the :class:`Schedule` and what follows from it alone: bytes, ticks, α-β-γ),
``symbolic`` (a generator ``n -> Schedule`` proved for every ``n``) and ``collectives``
(ring, reduce-scatter, all-gather, broadcast). :mod:`towers.allreduce.machinery.scheduled`
runs a schedule on TensorFlow devices; this package imports nothing of TensorFlow.
"""

from __future__ import annotations

from towers.schedule.collectives import (
    binomial_broadcast,
    chain_broadcast,
    doubling_all_gather,
    even_sizes,
    flat_broadcast,
    halving_reduce_scatter,
    ring_all_gather,
    ring_orders,
    ring_reduce_scatter,
    ring_schedule,
    rooted,
)
from towers.schedule.ir import (
    COLLECTIVES,
    KINDS,
    Generator,
    Schedule,
    Step,
    bytes_sent,
    chunk_bytes,
    cost,
    format_schedule,
)
from towers.schedule.symbolic import (
    ScheduleError,
    ScheduleReport,
    check_schedule,
    simulate,
    summation_depth,
)

__all__ = ["COLLECTIVES", "KINDS", "Generator", "Schedule", "ScheduleError", "ScheduleReport",
           "Step", "binomial_broadcast", "bytes_sent", "chain_broadcast", "check_schedule",
           "chunk_bytes", "cost", "doubling_all_gather", "even_sizes", "flat_broadcast",
           "format_schedule", "halving_reduce_scatter", "ring_all_gather", "ring_orders",
           "ring_reduce_scatter", "ring_schedule", "rooted", "simulate", "summation_depth"]
