"""See an algorithm run: tick tables, chunk-state pictures, a step-through viewer, timelines."""

from __future__ import annotations

from towers.trace.draw import draw, draw_state
from towers.trace.schedule import COLLECTIVE, start_devices, to_json, trace_all_reduce
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
           "trace_all_reduce", "trace_state", "write_html"]
