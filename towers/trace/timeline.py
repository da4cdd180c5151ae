"""One training step as a timeline for Perfetto (ui.perfetto.dev) or chrome://tracing.

Each phase of a digits-CNN ``TowerTrainer`` is compiled and timed apart, then laid out as
the step orders them: forward+backward per tower (split by profiled op time), the
all-reduce's ticks after the slowest tower, then the apply. A tower is a process with a
"compute" and an "all-reduce" thread; the whole compiled step has its own row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from towers.allreduce.machinery.base import as_written
from towers.allreduce.machinery.primitives import BOOKKEEPING_NOTES, Transfer, record
from towers.allreduce.machinery.resolve import get
from towers.bench.report import interleave
from towers.step import TowerTrainer
from towers.trace.measured import OpEvent, profile_step, split_compute
from towers.trace.table import assign_ticks
from towers.training.data import digits
from towers.training.models import digits_cnn

__all__ = ["TIMINGS", "build_timeline", "digits_trainer"]

TIMINGS = ("forward, backward (split by profiled op time), the whole all-reduce and the apply "
           "are measured; a tick's length is the all-reduce's time split by the bytes each "
           "tick moves (a model); positions are derived")
"""What the numbers mean, as the JSON's ``otherData`` says it."""


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


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` after one warm-up call (which also compiles it)."""
    return interleave({"phase": fn}, repeats, warmup=1)["phase"].median


def _compiled(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return tf.function(lambda: fn(*args), autograph=False)


def _measure(trainer: TowerTrainer, batch: tuple[Any, Any], repeats: int, bar: Any) -> _Phases:
    shards = trainer.split(*batch)
    compute = []
    for tower in range(len(trainer.devices)):
        compute.append(_median_seconds(_compiled(trainer.tower_step, shards, tower), repeats))
        bar.add(1)
    grads = _compiled(trainer.forward_backward, shards)()
    reduce = _compiled(trainer.reduce, grads)
    with record() as sent:  # sends are recorded when the first call traces it
        reduce_time = _median_seconds(reduce, repeats)
    apply_time = _median_seconds(_compiled(trainer.apply, reduce()), repeats)
    step = _median_seconds(lambda: trainer.train_step(*batch), repeats)
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
    """Per tick and place what it sent and got; tick lengths split the all-reduce's measured
    time in proportion to each tick's bytes."""
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
    places = list(trainer.devices)
    places += list(dict.fromkeys(d for t in phases.transfers for d in (t.src, t.dst)
                                 if d not in places))
    events: list[dict[str, Any]] = []
    for p, device in enumerate([*places, ""]):  # names: a process per place, then the step
        name = f"tower {p} ({device})" if p < n else device
        name = "whole step (compiled, measured)" if p == len(places) else name
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


def _report(phases: _Phases, ticks: int, repeats: int) -> str:
    def row(name: str, values: Sequence[float]) -> str:
        return f"{name:<28}" + "".join(f"{v * 1e3:>10.3f}" for v in values)

    n = len(phases.forward)
    moved = sum(t.nbytes or 0 for t in phases.transfers)
    laid_out = max(f + b for f, b in zip(phases.forward, phases.backward))
    laid_out += phases.reduce + phases.apply
    return "\n".join([
        f"{f'phase (ms, median of {repeats})':<28}" + "".join(f"{f'tower {i}':>10}"
                                                              for i in range(n)),
        row("forward", phases.forward), row("backward", phases.backward),
        row(f"all-reduce ({ticks} tick{'' if ticks == 1 else 's'}, {moved} B)", [phases.reduce]),
        row("apply (every replica)", [phases.apply]),
        f"whole step, compiled: {phases.step * 1e3:.3f} ms measured; phases laid out end to "
        f"end: {laid_out * 1e3:.3f} ms"])


def build_timeline(devices: list[str], *, algorithm: str = "ring", variables: str = "replicated",
                   batch_size: int = 64, repeats: int = 5,
                   seed: int = 0) -> tuple[dict[str, Any], str]:
    """Measure one step's phases on ``devices`` and lay them out: the chrome-trace dict
    (``traceEvents``, ``otherData``, the profiler's ``measuredOps``) and the timings table."""
    trainer, batch = digits_trainer(devices, algorithm=algorithm, variables=variables,
                                    batch_size=batch_size, seed=seed)
    bar = keras.utils.Progbar(len(devices) + 1, unit_name="phase")
    with as_written():
        phases = _measure(trainer, batch, repeats, bar)
    events = _events(trainer, phases)
    ticks = len({e["args"]["tick"] for e in events if "tick" in e["args"]})
    other = {"algorithm": algorithm, "towers": len(devices), "ticks": ticks,
             "variables": variables, "batch": batch_size, "timings": TIMINGS}
    data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other,
            "measuredOps": [list(e) for e in phases.events]}  # OpEvent fields
    return data, _report(phases, ticks, repeats)
