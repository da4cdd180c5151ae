"""The text side of a trace: the tick table and the summary under it.

:func:`format_table` prints one line per transfer of a
:class:`~towers.trace.Trace`, by tick then source tower; :func:`format_summary`
sums it up: bytes per tower against the algorithm's ``bytes_sent`` formula, ticks,
which tower finished which chunk, and the check against NumPy (ring, 4 towers)::

     tick  from      to          chunk    bytes  operation
        0  tower 0   -> tower 1      3       16  reduce
           tower 1   -> tower 2      0       16  reduce
    ...
    ring: 4 towers × 16 float32 (64 bytes each), op=sum: 24 transfers in 6 ticks
    bytes sent: tower 0 96 · tower 1 96 · tower 2 96 · tower 3 96 (total 384)
      = the algorithm's bytes_sent formula [96, 96, 96, 96]

Example:
    >>> print(format_table(trace)); print(format_summary(trace))   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type hints only: schedule.py does not import this module
    from towers.trace.schedule import Trace

__all__ = ["format_summary", "format_table"]


def _count(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def format_table(trace: Trace) -> str:
    """The tick table: one line per transfer, by tick then source tower.

    ``*`` after a tick: assigned by order; ``~`` before bytes: an estimate.
    """
    lines = [f"{'tick':>5}  {'from':<10}{'to':<12}{'chunk':>5}  {'bytes':>7}  operation"]
    shown = -1
    for r in sorted(trace.rows, key=lambda r: (r.tick, r.src)):
        tick = "" if r.tick == shown else f"{r.tick}{'*' if r.assigned else ''}"
        shown = r.tick
        chunk = "-" if r.chunk is None else str(r.chunk)
        nbytes = "?" if r.nbytes is None else f"{'~' if r.estimated else ''}{r.nbytes}"
        note = (r.note or "-") + (" (estimated)" if r.estimated else "")
        lines.append(
            f"{tick:>5}  {trace.place_name(r.src):<10}{'-> ' + trace.place_name(r.dst):<12}"
            f"{chunk:>5}  {nbytes:>7}  {note}"
        )
    if not trace.rows:
        lines.append("    -  (no transfers)")
    if any(r.assigned for r in trace.rows):
        lines.append("  * tick assigned by order (the algorithm gave none)")
    return "\n".join(lines)


def _ownership_lines(trace: Trace) -> list[str]:
    if not trace.holds:
        return ["chunk ownership: not observable (an opaque collective moved the data)"]
    label = "the whole buffer" if len(trace.chunks) == 1 else f"all {len(trace.chunks)} chunks"
    finished = " · ".join(
        f"c{c} on {trace.place_name(p)} (tick {t})"
        for c, (p, t) in sorted(trace.finished.items())
    )
    holding = [str(p) for p in range(trace.towers) if len(trace.holds[p]) == len(trace.chunks)]
    lines = [f"chunks finished: {finished}"] if finished else []
    return [*lines, f"holding {label} at the end: towers {', '.join(holding) or 'none'}"]


def format_summary(trace: Trace) -> str:
    """Bytes per tower (against the algorithm's formula), ticks, ownership, the NumPy check."""
    n, sent = trace.towers, trace.bytes_sent()
    head = (
        f"{trace.algorithm}: {n} towers × {trace.size} {trace.dtype} ({trace.size * 4} bytes "
        f"each), op={trace.op}: {len(trace.rows)} transfers in {_count(trace.ticks, 'tick')}"
    )
    estimated = any(r.estimated for r in trace.rows)
    per = " · ".join(f"{trace.place_name(p)} {b}" for p, b in enumerate(sent) if p < n or b)
    lines = [head, f"bytes sent{' (estimated)' if estimated else ''}: {per} (total {sum(sent)})"]
    if trace.formula is not None:
        same = list(trace.formula) == sent[:n]
        sign = "=" if same else "≠"
        lines.append(f"  {sign} the algorithm's bytes_sent formula {list(trace.formula)}")
    if trace.early:
        lines.append(
            f"note: by the algorithm's ticks, {trace.early} transfers leave no later than their "
            "data arrived (nested algorithms may each count from 0); --ticks order reschedules"
        )
    lines += _ownership_lines(trace)
    verdict = "OK" if trace.ok else "WRONG"
    agree = "bitwise identical" if trace.identical else "NOT identical"
    lines.append(
        f"result vs NumPy: {verdict}: max abs error {trace.max_abs_error:.3g} "
        f"({trace.max_ulps} ULP); outputs {agree} on all {n} towers"
    )
    return "\n".join(lines)
