"""The profiler's op events of one real training step, drawn beside the modelled timeline.

Ops are sorted into phases by their name scopes (:func:`towers.bench.phases.phase_of`)::

    replica_3/conv2d_1/Relu:Relu                       forward,  tower 3
    gradient_tape/replica_3/conv2d_1/Conv2DBackprop…   backward, tower 3
    guard/…, split/…, the all-reduce, the update       step (everything else)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from towers.bench.phases import phase_of as step_phase
from towers.trace.draw import pyplot, save_png

__all__ = ["OpEvent", "busy", "draw_measured", "phase_of", "profile_step", "read_xspace",
           "split_compute"]

class OpEvent(NamedTuple):
    """One op kernel as the profiler saw it; times in microseconds from the first event."""

    name: str
    op: str
    thread: str
    start: float
    duration: float


def phase_of(name: str) -> tuple[int | None, str]:
    """``(tower, phase)`` of an op by its name scope: forward, backward or step (tower None)."""
    phase, tower = step_phase(name)
    if phase != "forward_backward":
        return None, "step"
    return tower, "backward" if name.startswith("gradient_tape/") else "forward"


def read_xspace(path: str | os.PathLike[str]) -> list[OpEvent]:
    """The op events (``scope/name:Type``) of a profiler ``*.xplane.pb`` file, by start time."""
    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(path).read_bytes())
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for e in line.events:
                name = plane.event_metadata[e.metadata_id].name
                if ":" in name and "::" not in name and e.duration_ps > 0:
                    scope, op = name.rsplit(":", 1)
                    start = (line.timestamp_ns * 1000 + e.offset_ps) / 1e6
                    events.append(OpEvent(scope, op, line.name, start, e.duration_ps / 1e6))
    first = min((e.start for e in events), default=0.0)
    return sorted((e._replace(start=e.start - first) for e in events), key=lambda e: e.start)


def profile_step(trainer: Any, x: Any, y: Any) -> list[OpEvent]:
    """Profile one ``trainer.train_step(x, y)`` (after a warm-up step); its op events by start
    (``RuntimeError``: the profiler wrote none)."""
    trainer.train_step(x, y)  # compile outside the profile
    with tempfile.TemporaryDirectory() as where:
        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=3, python_tracer_level=0, device_tracer_level=0)
        tf.profiler.experimental.start(where, options=options)
        try:
            trainer.train_step(x, y)
        finally:
            tf.profiler.experimental.stop()
        found = sorted(Path(where).glob("plugins/profile/*/*.xplane.pb"),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise RuntimeError(f"the profiler wrote no *.xplane.pb under {where}")
        return read_xspace(found[-1])


def busy(events: Sequence[OpEvent], towers: int) -> dict[tuple[int | None, str], float]:
    """Microseconds of op time per ``(tower, phase)`` (the union of its events' intervals)."""
    spans: dict[tuple[int | None, str], list[tuple[float, float]]] = {}
    for e in events:
        tower, phase = phase_of(e.name)
        if tower is None or tower < towers:
            spans.setdefault((tower, phase), []).append((e.start, e.start + e.duration))
    out = {}
    for key, intervals in spans.items():
        total, end = 0.0, float("-inf")
        for a, b in sorted(intervals):
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        out[key] = total
    return out


def split_compute(
    compute: Sequence[float], events: Sequence[OpEvent]
) -> tuple[list[float], list[float]] | None:
    """Split each tower's measured forward+backward seconds by its profiled op-time shares:
    ``(forward, backward)`` per tower, or None when some tower's ops were not seen."""
    spent = busy(events, len(compute))
    shares = []
    for tower in range(len(compute)):
        f, b = spent.get((tower, "forward"), 0.0), spent.get((tower, "backward"), 0.0)
        if f <= 0 or b <= 0:
            return None
        shares.append(b / (f + b))
    return ([c * (1 - s) for c, s in zip(compute, shares)],
            [c * s for c, s in zip(compute, shares)])


_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "step": "0.5",
            "all-reduce": "tab:green", "apply": "tab:red"}


def draw_measured(events: Sequence[OpEvent], towers: int, path: str | os.PathLike[str], *,
                  modelled: dict[str, Any] | None = None) -> Path:
    """Draw the measured op events, one row per tower and phase, then the rest of the step
    (and, given, the modelled timeline below) as a PNG; returns ``path``."""
    keys = [(t, p) for t in range(towers) for p in ("forward", "backward")] + [(None, "step")]
    spent = busy(events, towers)
    fig, axes = pyplot().subplots(2 if modelled else 1, 1, squeeze=False, figsize=(
        11, 1.2 + 0.3 * len(keys) * (2 if modelled else 1)))
    ax = axes[0][0]
    for k, key in enumerate(keys):
        ax.broken_barh([(e.start / 1e3, e.duration / 1e3) for e in events
                        if phase_of(e.name) == key], (k - 0.35, 0.7), color=_COLOURS[key[1]])
    ax.set_yticks(range(len(keys)), [
        f"{'step (guard, reduce, apply)' if t is None else f'tower {t} {p}'}  "
        f"{spent.get((t, p), 0.0) / 1e3:.2f} ms" for t, p in keys], fontsize=7)
    ax.set_ylim(len(keys) - 0.5, -0.5)
    ax.set_title(f"measured (tf.profiler op events of one train_step, {len(events)} ops; "
                 "ms of op time per row)", fontsize=9)
    ax.set_xlabel("ms")
    if modelled:  # below: the modelled timeline
        ax = axes[1][0]
        for e in modelled["traceEvents"]:
            if e.get("ph") == "X" and e["pid"] < towers:
                kind = e["name"] if e["name"] in ("forward", "backward", "apply") else "all-reduce"
                ax.barh(e["pid"] * 2 + (e["tid"] == 1), e["dur"] / 1e3, left=e["ts"] / 1e3,
                        height=0.7, color=_COLOURS[kind])
        ax.set_yticks(range(2 * towers), [f"tower {p} {t}" for p in range(towers)
                                          for t in ("compute", "all-reduce")], fontsize=7)
        ax.set_ylim(2 * towers - 0.5, -0.5)
        ax.set_title("modelled (towers timeline: phases timed apart, laid end to end; "
                     "forward / backward / all-reduce / apply)", fontsize=9)
        ax.set_xlabel("ms")
    return save_png(fig, path, 100)
