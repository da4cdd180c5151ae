"""One training step as a timeline for Perfetto (ui.perfetto.dev), and as measured.

Modelled: each phase of a digits-CNN ``TowerTrainer`` is compiled and timed apart, then laid
out as the step orders them: forward+backward per tower (split by profiled op time), the
all-reduce's ticks after the slowest tower, then the apply; a tower is a process with a
"compute" and an "all-reduce" thread. Measured: the profiler's op events of one real step,
sorted into phases by name scope (:func:`towers.bench.phases.phase_of`)::

    replica_3/conv2d_1/Relu:Relu                       forward,  tower 3
    gradient_tape/replica_3/conv2d_1/Conv2DBackprop…   backward, tower 3
    guard/…, split/…, the all-reduce, the update       step (everything else)
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from towers.allreduce.machinery.base import as_written
from towers.allreduce.machinery.primitives import BOOKKEEPING_NOTES, Transfer, record
from towers.allreduce.machinery.resolve import get
from towers.bench.phases import phase_of as step_phase
from towers.bench.report import interleave
from towers.step import TowerTrainer
from towers.trace.draw import pyplot, save_png
from towers.trace.table import assign_ticks
from towers.training.data import digits
from towers.training.models import digits_cnn

__all__ = ["OpEvent", "build_timeline", "busy", "digits_trainer", "draw_measured",
           "phase_of", "profile_step", "split_compute"]

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


def profile_step(trainer: Any, x: Any, y: Any) -> list[OpEvent]:
    """The op events (``scope/name:Type``) of one ``trainer.train_step(x, y)`` after a
    warm-up, by start time (RuntimeError: the profiler wrote none)."""
    trainer.train_step(x, y)  # compile outside the profile
    with tempfile.TemporaryDirectory() as where:
        tf.profiler.experimental.start(where, options=tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=3, python_tracer_level=0, device_tracer_level=0))
        try:
            trainer.train_step(x, y)
        finally:
            tf.profiler.experimental.stop()
        found = sorted(Path(where).glob("plugins/profile/*/*.xplane.pb"), key=os.path.getmtime)
        if not found:
            raise RuntimeError(f"the profiler wrote no *.xplane.pb under {where}")
        space = xplane_pb2.XSpace()
        space.ParseFromString(found[-1].read_bytes())
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


def split_compute(compute: Sequence[float], events: Sequence[OpEvent]
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
    return [c * (1 - s) for c, s in zip(compute, shares)], [c * s for c, s in zip(compute, shares)]


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
    ax.set(xlabel="ms", ylim=(len(keys) - 0.5, -0.5))
    ax.set_title(f"measured (tf.profiler op events of one train_step, {len(events)} ops; "
                 "ms of op time per row)", fontsize=9)
    if modelled:  # below: the modelled timeline
        ax = axes[1][0]
        for e in modelled["traceEvents"]:
            if e.get("ph") == "X" and e["pid"] < towers:
                kind = e["name"] if e["name"] in ("forward", "backward", "apply") else "all-reduce"
                ax.barh(e["pid"] * 2 + (e["tid"] == 1), e["dur"] / 1e3, left=e["ts"] / 1e3,
                        height=0.7, color=_COLOURS[kind])
        ax.set_yticks(range(2 * towers), [f"tower {p} {t}" for p in range(towers)
                                          for t in ("compute", "all-reduce")], fontsize=7)
        ax.set(xlabel="ms", ylim=(2 * towers - 0.5, -0.5))
        ax.set_title("modelled (towers timeline: phases timed apart, laid end to end; "
                     "forward / backward / all-reduce / apply)", fontsize=9)
    return save_png(fig, path, 100)


class _Phases(NamedTuple):
    forward: list[float]  # seconds, per tower
    backward: list[float]
    reduce: float
    apply: float  # every replica, one call
    step: float
    whole: int  # one tower's gradient bytes
    transfers: list[Transfer]  # the all-reduce's sends (bookkeeping left out)
    events: list[OpEvent]  # the profiler's op events of one step (empty: no profile)


def digits_trainer(devices: list[str], *, algorithm: str = "ring", variables: str = "replicated",
                   batch_size: int = 64, seed: int = 0) -> tuple[TowerTrainer, tuple[Any, Any]]:
    """A ``TowerTrainer`` of the digits CNN (SGD 0.05) on ``devices``, and one global batch."""
    x, y, _, _ = digits(seed=seed)
    trainer = TowerTrainer(  # registry names go as names: "parameter_device" means its device
        lambda: digits_cnn(seed), lambda: keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), devices=devices,
        all_reduce=get(algorithm, argument="algorithm", devices=devices)
        if ":" in algorithm else algorithm, variables=variables)
    return trainer, (x[:batch_size], y[:batch_size])


def _measure(trainer: TowerTrainer, batch: tuple[Any, Any], repeats: int) -> _Phases:
    def compiled(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        return tf.function(lambda: fn(*args), autograph=False)

    def seconds(fn: Callable[[], Any]) -> float:  # median wall time after a warm-up call
        return interleave({"phase": fn}, repeats, warmup=1)["phase"].median

    bar = keras.utils.Progbar(len(trainer.devices) + 1, unit_name="phase")
    shards = trainer.split(*batch)
    compute = []
    for tower in range(len(trainer.devices)):
        compute.append(seconds(compiled(trainer.tower_step, shards, tower)))
        bar.add(1)
    grads = compiled(trainer.forward_backward, shards)()
    reduce = compiled(trainer.reduce, grads)
    with record() as sent:  # sends are recorded when the first call traces it
        reduce_time = seconds(reduce)
    apply_time = seconds(compiled(trainer.apply, reduce()))
    step = seconds(lambda: trainer.train_step(*batch))
    bar.add(1)
    try:
        events = profile_step(trainer, *batch)
    except RuntimeError:  # no profiler output here: forward+backward drawn as forward
        events = []
    forward, backward = split_compute(compute, events) or (compute, [0.0] * len(compute))
    whole = sum(int(g.shape.num_elements()) * g.dtype.size for g in grads.grads[0])
    transfers = [t for t in sent.transfers if t.note not in BOOKKEEPING_NOTES]
    return _Phases(forward, backward, reduce_time, apply_time, step, whole, transfers, events)


def _x(name: str, pid: int, tid: int, start: float, seconds: float, **args: Any) -> dict[str, Any]:
    """A chrome-trace complete event ("X"); times in microseconds."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(start * 1e6, 3),
            "dur": round(seconds * 1e6, 3), "cat": args.pop("cat", "compute"), "args": args}


def _tick_events(phases: _Phases, places: list[str], start: float) -> list[dict[str, Any]]:
    """Per tick and place what it sent and got; a tick lasts its bytes' share of the all-reduce."""
    ticks: dict[int, dict[str, Any]] = {}
    for row in assign_ticks(phases.transfers, places, phases.whole):
        tick = ticks.setdefault(row.tick, {"bytes": 0, "notes": [], "places": {},
                                           "estimated": False})
        tick["bytes"] += row.nbytes or 0
        tick["notes"].append(row.note)
        tick["estimated"] |= row.estimated
        for p, key in ((row.src, "sent"), (row.dst, "received")):
            entry = tick["places"].setdefault(p, {"sent": 0, "received": 0, "sends": 0})
            entry[key] += row.nbytes or 0
        tick["places"][row.src]["sends"] += 1
    moved, events, now = sum(t["bytes"] for t in ticks.values()), [], start
    for number, info in sorted(ticks.items()):
        seconds = phases.reduce * (info["bytes"] / moved if moved else 1 / len(ticks))
        note = max(info["notes"], key=info["notes"].count)
        events += [_x(f"tick {number}: {note}", p, 1, now, seconds, cat="all-reduce",
                      tick=number, estimated=info["estimated"], **entry)
                   for p, entry in sorted(info["places"].items())]
        now += seconds
    return events


def _events(trainer: TowerTrainer, phases: _Phases) -> list[dict[str, Any]]:
    n = len(trainer.devices)
    ends = (d for t in phases.transfers for d in (t.src, t.dst))
    places = list(dict.fromkeys([*trainer.devices, *ends]))  # the towers, then other places
    events: list[dict[str, Any]] = []
    for p, device in enumerate([*places, "whole step (compiled, measured)"]):  # the processes
        name = f"tower {p} ({device})" if p < n else device
        events += [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": name}},
                   {"name": "process_sort_index", "ph": "M", "pid": p, "args": {"sort_index": p}}]
        events += [{"name": "thread_name", "ph": "M", "pid": p, "tid": tid, "args": {"name": t}}
                   for tid, t in ((0, "compute"), (1, "all-reduce"))]
    for i in range(n):
        events += [_x("forward", i, 0, 0.0, phases.forward[i]),
                   _x("backward", i, 0, phases.forward[i], phases.backward[i])]
    start = max(f + b for f, b in zip(phases.forward, phases.backward))
    events += _tick_events(phases, places, start) or [  # an opaque algorithm that said nothing
        _x("all-reduce (no sends recorded)", i, 1, start, phases.reduce, cat="all-reduce")
        for i in range(n)]
    events += [_x("apply", places.index(replica.device), 0, start + phases.reduce,
                  phases.apply, replicas=len(trainer.replicas)) for replica in trainer.replicas]
    return [*events, _x("train_step", len(places), 0, 0.0, phases.step)]


def build_timeline(devices: list[str], *, algorithm: str = "ring", variables: str = "replicated",
                   batch_size: int = 64, repeats: int = 5,
                   seed: int = 0) -> tuple[dict[str, Any], str]:
    """Measure one step's phases on ``devices`` and lay them out: the chrome-trace dict
    (``traceEvents``, ``otherData``, the profiler's ``measuredOps``) and the timings table."""
    trainer, batch = digits_trainer(devices, algorithm=algorithm, variables=variables,
                                    batch_size=batch_size, seed=seed)
    with as_written():
        phases = _measure(trainer, batch, repeats)
    events = _events(trainer, phases)
    ticks = len({e["args"]["tick"] for e in events if "tick" in e["args"]})
    other = {"algorithm": algorithm, "towers": len(devices), "ticks": ticks,
             "variables": variables, "batch": batch_size, "timings": (
                 "forward, backward (split by profiled op time), the whole all-reduce and the "
                 "apply are measured; a tick's length is the all-reduce's time split by the "
                 "bytes each tick moves (a model); positions are derived")}
    data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other,
            "measuredOps": [list(e) for e in phases.events]}  # OpEvent fields

    def row(name: str, values: Sequence[float]) -> str:
        return f"{name:<28}" + "".join(f"{v * 1e3:>10.3f}" for v in values)

    moved = sum(t.nbytes or 0 for t in phases.transfers)
    laid_out = max(f + b for f, b in zip(phases.forward, phases.backward))
    laid_out += phases.reduce + phases.apply
    return data, "\n".join([
        f"{f'phase (ms, median of {repeats})':<28}"
        + "".join(f"{f'tower {i}':>10}" for i in range(len(devices))),
        row("forward", phases.forward), row("backward", phases.backward),
        row(f"all-reduce ({ticks} tick{'' if ticks == 1 else 's'}, {moved} B)", [phases.reduce]),
        row("apply (every replica)", [phases.apply]),
        f"whole step, compiled: {phases.step * 1e3:.3f} ms measured; phases laid out end to "
        f"end: {laid_out * 1e3:.3f} ms"])
