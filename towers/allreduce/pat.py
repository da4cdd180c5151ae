"""PAT all-reduce: NCCL's Parallel Aggregated Trees reduce-scatter and all-gather, composed.

Written as data: :func:`pat_schedule` builds the :class:`~towers.schedule.Schedule`
and :func:`~towers.allreduce.machinery.scheduled.run_schedule` runs it; its record's bytes and
depth are counted from that same object. n = 5 towers, chunks c0..c4,
``+▶t`` reduces into tower t, ``▶t`` copies to it::

    tick           0       1       2 │      3       4       5
                   reduce-scatter    │     all-gather (copy)
    tower 0  c1c3+▶1   c2+▶2   c4+▶4 │  c0 ▶1   c0 ▶3 c0c2 ▶4
    tower 1  c2c4+▶2   c3+▶3   c0+▶0 │  c1 ▶2   c1 ▶4 c1c3 ▶0
    tower 2  c0c3+▶3   c4+▶4   c1+▶1 │  c2 ▶3   c2 ▶0 c2c4 ▶1
    tower 3  c1c4+▶4   c0+▶0   c2+▶2 │  c3 ▶4   c3 ▶1 c0c3 ▶2
    tower 4  c0c2+▶0   c1+▶1   c3+▶3 │  c4 ▶0   c4 ▶2 c1c4 ▶3
                      tower r now owns c_r, finished

Index formula (K = ⌈log2 n⌉ dimensions): PAT is Bruck's algorithm
(:mod:`towers.allreduce.bruck`) with the dimensions reversed. Each chunk is
broadcast along its own binomial tree shifted to start at its owner (the "parallel
trees"), and all trees' transfers of one step travel in one message per peer (the
"aggregation"). Chunk c reaches tower ``c − j`` (offset j = 1..n−1) at the
dimension of j's *lowest* set bit ``k``, from the tower at offset ``j − 2^k``; the
all-gather runs k = K−1 down to 0, so tower r first copies its own chunk ``2^(K−1)``
away and ends copying about n/2 chunks to its neighbour ``r − 1``. The far hops
carry the little data, the near hops the much: the opposite of Bruck, whose last
step sends n/2 chunks ``2^(K−1)`` away — the long-distance traffic PAT avoids. The
reduce-scatter is that all-gather transposed and run backwards (arrows reversed,
copies become reductions): the big reductions happen between neighbours first, and
only one partial chunk crosses the longest distance, last.

Bounded buffers (``aggregation``): NCCL sizes PAT's staging buffer independently of
the operation and aggregates only as many trees per message as it holds. Here
``pat(aggregation=A)`` sends at most A chunks per tower per tick, splitting a
dimension over ⌈m/A⌉ ticks to the same peer (A = 1: one chunk per peer per tick,
n − 1 ticks per phase); the default None aggregates a whole dimension (⌈log2 n⌉
ticks per phase). What NCCL interleaves when it splits (it may start a nearer
dimension before a farther one finished) is not reproduced: the split ticks run
in dimension order.

Any n works without padding the tower count: offsets j < n are reached through
offsets ``j − 2^k < j``, so the trees are binomial trees cut at n (n = 5 above:
dimension 2 carries 1 chunk, dimension 1 one, dimension 0 two).
``towers.schedule.check_schedule`` proves the pattern for every n up to 64.

Padding: the buffer is cut into n chunks of ⌈L/n⌉ elements. Cost (S bytes, every
tower sends ``n − 1`` chunks per phase; ``m_k = ⌊(n − 1 − 2^k)/2^(k+1)⌋ + 1`` chunks
in dimension k): ``2·Σ_k ⌈m_k/A⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``, that is
``2⌈log2 n⌉·α + …`` when A is None. Summation depth ⌈log2 n⌉.

References:
    S. Jeaugey, "PAT: a new algorithm for all-gather and reduce-scatter operations
    at scale", arXiv:2506.20252, 2025 (followed: Bruck with the dimensions
    reversed, aggregation bounded by the buffer); NVIDIA, "New Scaling Algorithm and
    Initialization with NCCL 2.23" (developer blog, 2024); NVIDIA/nccl issues #1473
    and #1594 ("a variation of Bruck's algorithm reordering the schedule to keep the
    memory needs limited"; "a binomial tree algorithm").
"""

from __future__ import annotations

import functools
import math

from towers.allreduce.bruck import gather_ticks, steps_of, transpose
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
from towers.schedule.ir import Schedule

__all__ = ["PAT", "chunks_per_dimension", "cost", "pat", "pat_schedule"]


def _aggregation(aggregation: object) -> int | None:
    return None if aggregation is None else positive_int("aggregation", aggregation)


def _lowest_bit(j: int) -> int:
    return (j & -j).bit_length() - 1


def chunks_per_dimension(n: int) -> list[int]:
    """``m_k``: the chunks a tower sends in dimension k (offsets whose lowest set bit is k).

    Example:
        >>> chunks_per_dimension(5), chunks_per_dimension(8)
        ([2, 1, 1], [4, 2, 1])
    """
    return [(n - 1 - (1 << k)) // (1 << (k + 1)) + 1 for k in range(steps_of(n))]


@functools.lru_cache(maxsize=256)
def pat_schedule(n: int, aggregation: int | None = None) -> Schedule:
    """PAT's reduce-scatter then all-gather over ``n`` towers (see the module docstring).

    Args:
        n: the tower count, >= 1.
        aggregation: at most this many chunks per tower per tick (None: unbounded).

    Raises:
        ValueError: ``n`` or ``aggregation`` is not an int >= 1.

    Example:
        >>> pat_schedule(5).num_ticks, pat_schedule(5, aggregation=1).num_ticks
        (6, 8)
    """
    n = positive_int("n", n)
    batch = _aggregation(aggregation)
    gather = gather_ticks(n, range(steps_of(n) - 1, -1, -1), _lowest_bit, batch)
    return Schedule("pat", n, n, tuple(transpose(gather) + gather))


def pat(aggregation: int | None = None) -> Configured:
    """Build the PAT all-reduce (any tower count; see the module docstring).

    Args:
        aggregation: the most chunks a tower sends per tick (the bounded buffer);
            None aggregates whole dimensions.

    Returns:
        The configured algorithm ``(values, *, op="sum") -> list[tf.Tensor]``; its
        ``bytes_sent`` and ``summation_depth``, counted from the schedule, are
        ``2(n−1)·⌈L/n⌉·itemsize`` per tower and ``⌈log2 n⌉``.

    Raises:
        ValueError: ``aggregation`` is not None or an int >= 1.

    Example:
        >>> outs = pat(aggregation=2)(values, op="mean")   # doctest: +SKIP
    """
    return PAT(aggregation)


def _build(aggregation: int | None = None) -> AllReduce:
    return scheduled(functools.partial(pat_schedule, aggregation=_aggregation(aggregation)))


def cost(n: int, nbytes: float, aggregation: int | None = None) -> Coefficients:
    """α-β-γ coefficients: ``2·Σ_k ⌈m_k/A⌉·α + 2(n−1)/n·S·β + (n−1)/n·S·γ``.

    Example:
        >>> cost(4, 1000.0), cost(4, 1000.0, aggregation=1)
        ((4, 1500.0, 750.0), (6, 1500.0, 750.0))
    """
    batch = _aggregation(aggregation)
    per = chunks_per_dimension(n)
    ticks = len(per) if batch is None else sum(math.ceil(m / batch) for m in per)
    return 2 * ticks, 2 * (n - 1) / n * nbytes, (n - 1) / n * nbytes


PAT = register(
    Algorithm("pat", _build, schedule=schedule_of(__doc__),
              **from_schedule(pat_schedule, cost=cost))
)
