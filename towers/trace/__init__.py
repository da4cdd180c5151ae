"""See an algorithm run: tick tables, pictures and step timelines.

    schedule.py  run one all-reduce under ``record()``, checked against NumPy
    table.py     the Trace: a tick for every transfer, chunk ownership, the table as text
    state.py     every tower's chunk state per tick, read from what each send carries,
                 and the links it used, laid out (ring, tree, butterfly, torus)
    draw.py      the tick picture and the state picture (PNG)
    viewer.py    the step-through viewer: one self-contained HTML page
    timeline.py  one training step as a chrome://tracing / Perfetto JSON
    measured.py  the profiler's op events of one real step, drawn beside the model
"""

from __future__ import annotations

from towers.trace.draw import draw, draw_state
from towers.trace.schedule import (
           COLLECTIVE,
           start_devices,
           to_json,
           trace_all_reduce,
           transfers_from_json,
)
from towers.trace.state import StateTrace, trace_state
from towers.trace.table import (
           Trace,
           TraceRow,
           assign_ticks,
           chunk_ownership,
           format_summary,
           format_table,
)
from towers.trace.viewer import write_html

__all__ = ["COLLECTIVE", "StateTrace", "Trace", "TraceRow", "assign_ticks", "chunk_ownership",
           "draw", "draw_state", "format_summary", "format_table", "start_devices", "to_json",
           "trace_all_reduce", "trace_state", "transfers_from_json", "write_html"]
