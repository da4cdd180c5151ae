"""Write one training step as a timeline for Perfetto (ui.perfetto.dev) or chrome://tracing.

A small CNN on the bundled 8×8 digits is trained over simulated towers with
``TowerTrainer``; the trainer's own phases are then compiled one by one and timed
(median of --repeats runs after a warm-up run):

  forward     per tower: trainer.tower_step(shards, i) (forward and backward) timed,
  backward    then split by the op times tf.profiler saw for that tower in one profiled
              train_step (ops under gradient_tape/tower_i are backward; see
              towers.trace.measured); without a profile, backward is that time
              minus a forward-only run's (noisy on shared cores: often 0)
  all-reduce  trainer.reduce(grads): every gradient through --algorithm, the
              non-trainable state and the loss
  apply       trainer.apply(reduced): the optimizer's update, every replica at once

and laid out as the step orders them: the towers start together, the reduction
starts when the slowest tower's backward ends, its ticks follow one another, and
the apply follows. Each tick's events sit on the towers that send or receive in
it (args list the transfers, summed over variables).

What the numbers mean: forward, backward, apply and the whole all-reduce are
measured; a tick's length is the all-reduce's measured time split over its ticks
in proportion to the bytes each moves (the ticks of one compiled all-reduce are
not timed one by one), so tick lengths are a model, and all positions are
derived. Ticks are the algorithm's own, summed over the variables; the loss and
state sends of the reduce phase are timed with it but drawn as no tick. The
whole compiled step is measured too (its own row) and differs from the laid-out
phases: pieces compiled apart each pay a call's overhead and cannot
overlap, and the whole step runs its towers side by side on the host's shared
cores (a tower timed alone runs faster).

Every tower gets a process (pid) with a "compute" and an "all-reduce" thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from towers.allreduce.machinery.ordering import as_written
from towers.allreduce.machinery.primitives import record
from towers.allreduce.machinery.resolve import get
from towers.step import TowerTrainer
from towers.trace.measured import OpEvent, profile_step, split_compute
from towers.trace.ticks import assign_ticks
from towers.training.data import digits
from towers.training.models import digits_cnn

__all__ = ["BOOKKEEPING", "build_timeline", "validate"]

BOOKKEEPING = ("loss", "state")
"""Notes of the reduce phase's sends that are not the all-reduce (drawn as no tick)."""


# -- measuring ----------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` after one warm-up call (which also compiles it)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Setup(NamedTuple):
    trainer: Any
    batch: tuple[Any, Any]


def _setup(args: argparse.Namespace, devices: list[str]) -> _Setup:
    import keras

    # Registry names go to the trainer as names ("parameter_device" means its device).
    algorithm = args.algorithm
    if ":" in algorithm:
        algorithm = get(algorithm, argument="algorithm", devices=devices)
    x, y, _, _ = digits(seed=args.seed)
    trainer = TowerTrainer(
        lambda: digits_cnn(args.seed),
        lambda: keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=devices, all_reduce=algorithm, variables=args.variables,
    )
    return _Setup(trainer, (x[: args.batch_size], y[: args.batch_size]))


def _compiled(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[], Any]:
    """``fn(*args, **kwargs)`` as one compiled call (the trainer's phases take no tape)."""
    import tensorflow as tf

    return tf.function(lambda: fn(*args, **kwargs), autograph=False)


class _Phases(NamedTuple):
    forward: list[float]  # seconds, per tower
    backward: list[float]
    reduce: float
    apply: float  # every replica, one call
    step: float
    groups: list[tuple[int, list[Any]]]  # (bytes per tower, the all-reduce's transfers)
    events: list[OpEvent] | None  # the profiler's op events of one step (None: no profile)


def _group(grads: Any, transfers: list[Any]) -> tuple[int, list[Any]]:
    """The all-reduce's sends (bookkeeping left out) and one tower's gradient bytes."""
    whole = sum(int(g.shape.num_elements()) * g.dtype.size for g in grads.grads[0])
    return whole, [t for t in transfers if t.note not in BOOKKEEPING]


def _measure(setup: _Setup, repeats: int, bar: Any) -> _Phases:
    trainer = setup.trainer
    shards = trainer.split(*setup.batch)
    forward: list[float] = []
    backward: list[float] = []
    compute: list[float] = []
    for tower in range(len(trainer.devices)):
        fwd = _compiled(trainer.tower_step, shards, tower, backward=False)
        forward.append(_median_seconds(fwd, repeats))
        compute.append(_median_seconds(_compiled(trainer.tower_step, shards, tower), repeats))
        backward.append(max(compute[-1] - forward[-1], 0.0))
        bar.add(1)
    grads = _compiled(trainer.forward_backward, shards)()
    reduce = _compiled(trainer.reduce, grads)
    with record() as sent:  # sends are recorded when the first call traces it
        reduce_time = _median_seconds(reduce, repeats)
    reduced = reduce()
    bar.add(1)
    apply_time = _median_seconds(_compiled(trainer.apply, reduced), repeats)
    bar.add(1)
    step = _median_seconds(lambda: trainer.train_step(*setup.batch), repeats)
    bar.add(1)
    group = _group(grads, sent.transfers)
    try:
        events: list[OpEvent] | None = profile_step(trainer, *setup.batch)
    except RuntimeError:  # no profiler output here: keep the subtraction
        events = None
    split = split_compute(compute, events) if events else None
    forward, backward = split or (forward, backward)
    return _Phases(forward, backward, reduce_time, apply_time, step, [group], events)


# -- laying out ---------------------------------------------------------------------------------


def _places(devices: Sequence[str], groups: list[tuple[int, list[Any]]]) -> list[str]:
    places = list(devices)
    for _, transfers in groups:
        for t in transfers:
            places += [d for d in (t.src, t.dst) if d not in places]
    return places


def _ticks(groups: list[tuple[int, list[Any]]], places: list[str]) -> dict[int, dict[str, Any]]:
    """Per tick, summed over every all-reduce call: bytes, and per place what it sent/got."""
    out: dict[int, dict[str, Any]] = {}
    for whole, transfers in groups:
        for row in assign_ticks(transfers, places, whole):
            tick = out.setdefault(row.tick, {"bytes": 0, "notes": {}, "places": {}})
            tick["bytes"] += row.nbytes or 0
            tick["notes"][row.note] = tick["notes"].get(row.note, 0) + 1
            for p, key in ((row.src, "sent"), (row.dst, "received")):
                entry = tick["places"].setdefault(p, {"sent": 0, "received": 0, "sends": 0})
                entry[key] += row.nbytes or 0
            tick["places"][row.src]["sends"] += 1
            tick["estimated"] = tick.get("estimated", False) or row.estimated
    return out


def _x(name: str, pid: int, tid: int, start: float, seconds: float, **args: Any) -> dict[str, Any]:
    """A chrome-trace complete event ("X"); times in microseconds."""
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": round(start * 1e6, 3),
            "dur": round(seconds * 1e6, 3), "cat": args.pop("cat", "compute"), "args": args}


def _metadata(places: list[str], towers: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for p, device in enumerate([*places, "whole step"]):
        label = f"tower {p} ({device})" if p < towers else device
        if p == len(places):
            label = "whole step (compiled, measured)"
        events.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": p,
                       "args": {"sort_index": p}})
        for tid, thread in ((0, "compute"), (1, "all-reduce")):
            events.append({"name": "thread_name", "ph": "M", "pid": p, "tid": tid,
                            "args": {"name": thread}})
    return events


def _tick_events(
    ticks: dict[int, dict[str, Any]], start: float, total: float
) -> list[dict[str, Any]]:
    """Tick lengths: the measured all-reduce time split in proportion to each tick's bytes."""
    moved = sum(t["bytes"] for t in ticks.values())
    events, now = [], start
    for tick in sorted(ticks):
        info = ticks[tick]
        share = info["bytes"] / moved if moved else 1 / len(ticks)
        note = max(info["notes"], key=info["notes"].get)
        for p, entry in sorted(info["places"].items()):
            events.append(_x(f"tick {tick}: {note}", p, 1, now, total * share, cat="all-reduce",
                             tick=tick, estimated=info.get("estimated", False), **entry))
        now += total * share
    return events


def _events(trainer: Any, phases: _Phases) -> tuple[list[dict[str, Any]], int]:
    devices, n = trainer.devices, len(trainer.devices)
    places = _places(devices, phases.groups)
    events = _metadata(places, n)
    for i in range(n):
        events.append(_x("forward", i, 0, 0.0, phases.forward[i]))
        events.append(_x("backward", i, 0, phases.forward[i], phases.backward[i]))
    start = max(f + b for f, b in zip(phases.forward, phases.backward))
    ticks = _ticks(phases.groups, places)
    if ticks:
        events += _tick_events(ticks, start, phases.reduce)
    else:  # an opaque algorithm that reported nothing
        events += [_x("all-reduce (no sends recorded)", i, 1, start, phases.reduce,
                      cat="all-reduce") for i in range(n)]
    for replica in trainer.replicas:  # one compiled call updates them all
        events.append(_x("apply", places.index(replica.device), 0, start + phases.reduce,
                         phases.apply, replicas=len(trainer.replicas)))
    events.append(_x("train_step", len(places), 0, 0.0, phases.step))
    return events, len(ticks)


def validate(data: dict[str, Any], towers: int, ticks: int) -> None:
    """Check a timeline: well-formed complete events, forward/backward on every tower,
    and at least one event for every tick.

    Raises:
        ValueError: what is missing or malformed.
    """
    events = data.get("traceEvents")
    if not isinstance(events, list) or not events:
        raise ValueError("no traceEvents list")
    complete = [e for e in events if e.get("ph") == "X"]
    for e in complete:
        if not {"name", "ts", "dur", "pid", "tid"} <= e.keys() or e["dur"] < 0 or e["ts"] < 0:
            raise ValueError(f"malformed complete event {e}")
    for tower in range(towers):
        names = {e["name"] for e in complete if e["pid"] == tower}
        if not {"forward", "backward"} <= names:
            raise ValueError(f"tower {tower} lacks forward/backward events: {sorted(names)}")
    seen = {e["args"]["tick"] for e in complete if "tick" in e.get("args", {})}
    if seen != set(range(ticks)):
        raise ValueError(f"tick events for {sorted(seen)}, expected 0..{ticks - 1}")


def _report(phases: _Phases, towers: int, ticks: int, repeats: int) -> str:
    ms = 1e3
    head = "".join(f"{f'tower {i}':>10}" for i in range(towers))
    lines = [f"{'phase (ms, median of ' + str(repeats) + ')':<28}{head}"]
    for name, values in (("forward", phases.forward), ("backward", phases.backward)):
        lines.append(f"{name:<28}" + "".join(f"{v * ms:>10.3f}" for v in values))
    moved = sum(t.nbytes or 0 for _, group in phases.groups for t in group)
    label = f"all-reduce ({ticks} tick{'' if ticks == 1 else 's'}, {moved} B)"
    lines.append(f"{label:<28}{phases.reduce * ms:>10.3f}")
    lines.append(f"{'apply (every replica)':<28}{phases.apply * ms:>10.3f}")
    laid_out = max(f + b for f, b in zip(phases.forward, phases.backward))
    laid_out += phases.reduce + phases.apply
    lines.append(f"whole step, compiled: {phases.step * ms:.3f} ms measured; "
                 f"phases laid out end to end: {laid_out * ms:.3f} ms")
    return "\n".join(lines)


def _meaning() -> str:
    """The docstring's paragraph on what the numbers mean, on one line."""
    text = (__doc__ or "").split("What the numbers mean: ")[-1].split("\n\n")[0]
    return " ".join(text.split())


def build_timeline(args: argparse.Namespace, devices: list[str]) -> tuple[dict[str, Any], str]:
    """Measure one step's phases on ``devices`` and lay them out.

    Returns:
        ``(data, report)``: the chrome-trace dict (``traceEvents``, ``otherData``) and
        the table of timings printed by ``towers timeline``.
    """
    import keras


    setup = _setup(args, devices)
    bar = keras.utils.Progbar(len(devices) + 3, unit_name="phase")
    with as_written():
        phases = _measure(setup, args.repeats, bar)
    events, ticks = _events(setup.trainer, phases)
    other = {"algorithm": args.algorithm, "towers": len(devices), "ticks": ticks,
             "variables": args.variables, "batch": args.batch_size, "timings": _meaning()}
    data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other,
            "measuredOps": [list(e) for e in phases.events or []]}  # OpEvent fields
    return data, _report(phases, len(devices), ticks, args.repeats)
