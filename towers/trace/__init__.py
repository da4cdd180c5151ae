"""See an algorithm run: tick tables, pictures and step timelines.

    schedule.py  run one all-reduce under ``record()``: who sends which chunk where, tick by tick
    loading.py   start_devices(): the tools' devices, whether or not TensorFlow has started
    ticks.py     a tick for every transfer (the algorithm's, or by order) and chunk ownership
    text.py      the tick table and summary as text
    draw.py      the schedule as a PNG (towers as rows, ticks as columns)
    state.py     every tower's chunk state per tick, read from what each send carries
    topology.py  the links an algorithm used, laid out: ring, tree, butterfly, torus
    picture.py   the links and the state per tick as a PNG
    viewer.py    the step-through viewer: one self-contained HTML page
    timeline.py  one training step as a chrome://tracing / Perfetto JSON

Example:
    >>> from towers.trace import trace_all_reduce, format_table, draw   # doctest: +SKIP
    >>> t = trace_all_reduce("ring", devices[:4], size=16)
    >>> print(format_table(t)); draw(t, "ring.png")
"""

from __future__ import annotations

from towers.trace.draw import draw
from towers.trace.picture import draw_state
from towers.trace.schedule import (
    COLLECTIVE,
    Trace,
    TraceRow,
    assign_ticks,
    chunk_ownership,
    start_devices,
    to_json,
    trace_all_reduce,
    transfers_from_json,
)
from towers.trace.state import StateTrace, trace_state
from towers.trace.text import format_summary, format_table
from towers.trace.viewer import write_html

__all__ = [
    "COLLECTIVE",
    "StateTrace",
    "Trace",
    "TraceRow",
    "assign_ticks",
    "chunk_ownership",
    "draw",
    "draw_state",
    "format_summary",
    "format_table",
    "start_devices",
    "to_json",
    "trace_all_reduce",
    "trace_state",
    "transfers_from_json",
    "write_html",
]
