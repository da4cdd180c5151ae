"""The tick table (:class:`Trace`): a tick for every transfer, chunk ownership, and as text.

A transfer without the algorithm's own tick gets one **by order**: one after the later of its
source's last send, its destination's last receive and its data's arrival (the cost model's
single-port model). A tower *holds* a chunk once every contribution could have reached it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from towers.allreduce.machinery.primitives import Transfer

__all__ = ["Trace", "TraceRow", "assign_ticks", "chunk_ownership", "format_summary", "format_table"]


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


@dataclasses.dataclass(frozen=True)
class Trace:
    """What one traced all-reduce did; ``places[:towers]`` are the towers' devices."""

    algorithm: str
    places: tuple[str, ...]
    towers: int
    op: str
    size: int
    dtype: str
    transfers: tuple[Transfer, ...]  # as recorded (or estimated), in program order
    rows: tuple[TraceRow, ...]
    finished: dict[int, tuple[int, int]]  # chunk -> (place, tick) where it was first held
    holds: tuple[frozenset[int], ...]  # per place: chunks held complete at the end
    formula: tuple[int, ...] | None  # the algorithm's bytes_sent, if it has one
    max_abs_error: float
    max_ulps: int
    identical: bool  # outputs bitwise identical across towers

    @property
    def ticks(self) -> int:
        return 1 + max((r.tick for r in self.rows), default=-1)

    @property
    def chunks(self) -> list[int]:
        """The chunk labels followed for ownership (``[0]``: the whole buffer)."""
        return sorted({c for held in self.holds for c in held} | set(self.finished)) or [0]

    @property
    def ok(self) -> bool:
        """True when every output is within ``towers + 2`` ULPs of NumPy's and all agree."""
        return self.identical and self.max_ulps <= self.towers + 2

    @property
    def early(self) -> int:
        """Rows the algorithm placed no later than the tick their data reached their source."""
        return sum(not r.assigned and not r.estimated and r.tick <= r.ready for r in self.rows)

    def place_name(self, p: int) -> str:
        return f"tower {p}" if p < self.towers else self.places[p]

    def note(self, tick: int) -> str:
        """The most common note of the tick's rows (``reduce``, ``copy``, …)."""
        notes = [r.note for r in self.rows if r.tick == tick and r.note]
        return max(set(notes), key=notes.count) if notes else ""

    def bytes_sent(self) -> list[int]:
        """Bytes sent per place (unknown sizes as 0)."""
        out = [0] * len(self.places)
        for r in self.rows:
            out[r.src] += r.nbytes or 0
        return out


def _covered(chunk: int | None, nbytes: int | None, whole: int, unit: int,
             labels: list[int]) -> list[int]:
    """The chunk labels a transfer carries."""
    if chunk is None or nbytes is None or nbytes >= whole or not unit:
        return labels
    span = max(1, round(nbytes / unit))
    return [c for c in range(chunk, chunk + span) if c in labels] or [chunk]


def _labels(transfers: Sequence[Transfer], whole: int) -> tuple[list[int], int]:
    """The chunk labels of partial transfers and the smallest labelled piece's size."""
    pieces = [t for t in transfers if t.chunk is not None and t.nbytes and t.nbytes < whole]
    labels = sorted({t.chunk for t in pieces if t.chunk is not None})
    return labels or [0], min((t.nbytes or 0 for t in pieces), default=0)


def assign_ticks(transfers: Sequence[Transfer], places: Sequence[str], whole: int, *,
                 by_order: bool = False,
                 sources: Sequence[frozenset[int] | None] = ()) -> list[TraceRow]:
    """Rows with a tick each: the algorithm's, or (``tick=None``, or ``by_order``) by order;
    ``whole``: one tower's bytes; ``sources``: per transfer, the transfers it was computed from."""
    labels, unit = _labels(transfers, whole)
    last_send, last_recv = [-1] * len(places), [-1] * len(places)
    got: list[dict[int, int]] = [{} for _ in places]
    rows: list[TraceRow] = []
    for i, t in enumerate(transfers):
        s, d = places.index(t.src), places.index(t.dst)
        carried = [] if t.estimated else _covered(t.chunk, t.nbytes, whole, unit, labels)
        followed = sources[i] if i < len(sources) else None
        arrivals = ((rows[j].tick for j in followed) if followed is not None
                    else (got[s].get(c, -1) for c in carried))  # fmt: skip
        ready = -1 if t.estimated else max(arrivals, default=-1)
        assigned = t.tick is None or by_order
        tick = 1 + max(last_send[s], last_recv[d], ready) if assigned else int(t.tick or 0)
        last_send[s], last_recv[d] = max(last_send[s], tick), max(last_recv[d], tick)
        for c in carried:
            got[d][c] = max(got[d].get(c, -1), tick)
        rows.append(TraceRow(tick, s, d, t.chunk, t.nbytes, t.note, t.estimated, assigned, ready))
    return rows


def chunk_ownership(transfers: Sequence[Transfer], rows: Sequence[TraceRow], towers: int,
                    places: int, whole: int
                    ) -> tuple[dict[int, tuple[int, int]], tuple[frozenset[int], ...]]:
    """``(finished, holds)``: ``finished[chunk] = (place, tick)`` where the chunk first held
    every contribution, and per place the chunks held complete at the end (empty when every
    row is estimated)."""
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


def format_table(trace: Trace) -> str:
    """One line per transfer, by tick then source (``*``: tick by order; ``~``: estimated)::

         tick  from      to          chunk    bytes  operation
            0  tower 0   -> tower 1      3       16  reduce
    """
    lines = [f"{'tick':>5}  {'from':<10}{'to':<12}{'chunk':>5}  {'bytes':>7}  operation"]
    shown = -1
    for r in sorted(trace.rows, key=lambda r: (r.tick, r.src)):
        tick = "" if r.tick == shown else f"{r.tick}{'*' if r.assigned else ''}"
        shown = r.tick
        chunk = "-" if r.chunk is None else str(r.chunk)
        nbytes = "?" if r.nbytes is None else f"{'~' if r.estimated else ''}{r.nbytes}"
        note = (r.note or "-") + (" (estimated)" if r.estimated else "")
        lines.append(f"{tick:>5}  {trace.place_name(r.src):<10}"
                     f"{'-> ' + trace.place_name(r.dst):<12}{chunk:>5}  {nbytes:>7}  {note}")
    if not trace.rows:
        lines.append("    -  (no transfers)")
    if any(r.assigned for r in trace.rows):
        lines.append("  * tick assigned by order (the algorithm gave none)")
    return "\n".join(lines)


def format_summary(trace: Trace) -> str:
    """Bytes per tower (against the algorithm's formula), ticks, ownership, the NumPy check."""
    n, sent = trace.towers, trace.bytes_sent()
    ticks = f"{trace.ticks} tick{'' if trace.ticks == 1 else 's'}"
    estimated = " (estimated)" if any(r.estimated for r in trace.rows) else ""
    per = " · ".join(f"{trace.place_name(p)} {b}" for p, b in enumerate(sent) if p < n or b)
    lines = [f"{trace.algorithm}: {n} towers × {trace.size} {trace.dtype} ({trace.size * 4} "
             f"bytes each), op={trace.op}: {len(trace.rows)} transfers in {ticks}",
             f"bytes sent{estimated}: {per} (total {sum(sent)})"]
    if trace.formula is not None:
        sign = "=" if list(trace.formula) == sent[:n] else "≠"
        lines.append(f"  {sign} the algorithm's bytes_sent formula {list(trace.formula)}")
    if trace.early:
        lines.append(f"note: by the algorithm's ticks, {trace.early} transfers leave no later "
                     "than their data arrived (nested algorithms may each count from 0); "
                     "--ticks order reschedules")
    if not trace.holds:
        lines.append("chunk ownership: not observable (an opaque collective moved the data)")
    else:
        finished = " · ".join(f"c{c} on {trace.place_name(p)} (tick {t})"
                              for c, (p, t) in sorted(trace.finished.items()))
        whole = len(trace.chunks)
        label = "the whole buffer" if whole == 1 else f"all {whole} chunks"
        holding = [str(p) for p in range(n) if len(trace.holds[p]) == whole]
        lines += [f"chunks finished: {finished}"] if finished else []
        lines.append(f"holding {label} at the end: towers {', '.join(holding) or 'none'}")
    agree = "bitwise identical" if trace.identical else "NOT identical"
    return "\n".join([*lines, f"result vs NumPy: {'OK' if trace.ok else 'WRONG'}: max abs error "
                      f"{trace.max_abs_error:.3g} ({trace.max_ulps} ULP); outputs {agree} on "
                      f"all {n} towers"])
