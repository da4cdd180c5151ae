"""Give every recorded transfer a tick and follow which tower holds which chunk.

This module owns the two passes from recorded transfers to the rows of a tick
table: :func:`assign_ticks` and :func:`chunk_ownership`. Ticks are the
algorithm's own (``send(..., tick=t)``). A transfer without one gets one **by
order**: one tick after the later of its source's previous send, its
destination's previous receive and the last receive at its source of a chunk it
carries (one send and one receive per device per tick, the single-port model of
:mod:`towers.bench.costmodel`, and never before its data can exist)::

    tower 0  ──c0──▶ tower 1                    tick 0 (nothing sent before)
    tower 1  ──c0──▶ tower 2                    tick 1 (after c0 reached tower 1 at 0)
    tower 2  ──c1──▶ tower 0                    tick 0 (tower 2 had sent nothing)

When the data was followed (``sources``, from ``record(follow_data=True)``: the
transfers whose received tensors a send's tensor was computed from), a send's data
arrived when the latest of those did, whatever the chunk labels say: in an
exchange where both towers send their whole buffer in one tick, neither send
carries what the other receives. Without it (eager runs), the labels decide.

Chunk ownership is followed by data flow over the rows in program order: a
transfer with chunk label ``c`` of ``b`` bytes carries chunks ``c .. c + b/u - 1``
(``u``: the smallest labelled piece); a transfer without a label, or of the
whole buffer, carries every chunk. A receiver is assumed to combine what it
gets, so a tower *holds* chunk ``c`` once contributions from every tower could
have reached it; the first tower to hold it *finished* it. Estimated rows (an
opaque collective's) wait for no data and carry none.

Example:
    >>> rows = assign_ticks(transfers, places, whole=64)                  # doctest: +SKIP
    >>> finished, holds = chunk_ownership(transfers, rows, 4, len(places), 64)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from towers.allreduce.machinery.primitives import Transfer

__all__ = ["TraceRow", "assign_ticks", "chunk_ownership"]


@dataclasses.dataclass(frozen=True)
class TraceRow:
    """One transfer as shown: places are indices into :attr:`Trace.places`."""

    tick: int
    src: int
    dst: int
    chunk: int | None
    nbytes: int | None
    note: str
    estimated: bool = False
    assigned: bool = False  # the tick was given by order, not by the algorithm
    ready: int = -1  # the tick its data reached its source (-1: the source's own input)


def _covered(
    chunk: int | None, nbytes: int | None, whole: int, unit: int, labels: list[int]
) -> list[int]:
    """The chunk labels a transfer carries (see the module docstring)."""
    if chunk is None or nbytes is None or nbytes >= whole or not unit:
        return labels
    span = max(1, round(nbytes / unit))
    return [c for c in range(chunk, chunk + span) if c in labels] or [chunk]


def _labels(transfers: Sequence[Transfer], whole: int) -> tuple[list[int], int]:
    """The chunk labels of partial transfers and the smallest labelled piece's size."""
    pieces = [t for t in transfers if t.chunk is not None and t.nbytes and t.nbytes < whole]
    labels = sorted({t.chunk for t in pieces if t.chunk is not None})
    return labels or [0], min((t.nbytes or 0 for t in pieces), default=0)


def assign_ticks(
    transfers: Sequence[Transfer],
    places: Sequence[str],
    whole: int,
    *,
    by_order: bool = False,
    sources: Sequence[frozenset[int] | None] = (),
) -> list[TraceRow]:
    """Rows with a tick each: the algorithm's, or (``tick=None``, or ``by_order``) by order.

    By order, a transfer goes one tick after the latest of: its source's previous
    send, its destination's previous receive, and the arrival of its data: the
    latest of ``sources[i]`` (the earlier transfers its tensor was computed from)
    when known, else its source's last receive of a chunk it carries (``whole``:
    the bytes of one tower's buffer, see the module docstring).
    """
    labels, unit = _labels(transfers, whole)
    last_send, last_recv = [-1] * len(places), [-1] * len(places)
    got: list[dict[int, int]] = [{} for _ in places]
    rows: list[TraceRow] = []
    for i, t in enumerate(transfers):
        s, d = places.index(t.src), places.index(t.dst)
        # Estimated rows sum up a whole opaque collective: they wait for no data.
        carried = [] if t.estimated else _covered(t.chunk, t.nbytes, whole, unit, labels)
        followed = sources[i] if i < len(sources) else None
        if t.estimated:
            ready = -1
        elif followed is not None:
            ready = max((rows[j].tick for j in followed), default=-1)
        else:
            ready = max((got[s].get(c, -1) for c in carried), default=-1)
        assigned = t.tick is None or by_order
        tick = 1 + max(last_send[s], last_recv[d], ready) if assigned else int(t.tick or 0)
        last_send[s], last_recv[d] = max(last_send[s], tick), max(last_recv[d], tick)
        for c in carried:
            got[d][c] = max(got[d].get(c, -1), tick)
        rows.append(TraceRow(tick, s, d, t.chunk, t.nbytes, t.note, t.estimated, assigned, ready))
    return rows


def chunk_ownership(
    transfers: Sequence[Transfer], rows: Sequence[TraceRow], towers: int, places: int, whole: int
) -> tuple[dict[int, tuple[int, int]], tuple[frozenset[int], ...]]:
    """Follow each chunk's contributions through the rows in program order.

    Returns:
        ``(finished, holds)``: ``finished[chunk] = (place, tick)`` where the chunk first
        held every tower's contribution, and per place the chunks it holds complete at
        the end. Estimated rows carry no data here; when every row is estimated the
        ownership is not observable and ``holds`` is empty.
    """
    if towers > 1 and all(r.estimated for r in rows):
        return {}, ()
    labels, unit = _labels(transfers, whole)
    everyone = set(range(towers))
    state = [{c: {p} if p < towers else set() for c in labels} for p in range(places)]
    finished: dict[int, tuple[int, int]] = {}
    for r in rows:
        if r.estimated:
            continue
        for c in _covered(r.chunk, r.nbytes, whole, unit, labels):
            state[r.dst][c] |= state[r.src][c]
            if c not in finished and state[r.dst][c] >= everyone:
                finished[c] = (r.dst, r.tick)
    holds = tuple(frozenset(c for c in labels if state[p][c] >= everyone) for p in range(places))
    return finished, holds
