"""Write one training step as a timeline for Perfetto (ui.perfetto.dev) or chrome://tracing.

A small CNN on the bundled 8×8 digits is trained over simulated towers with
``TowerTrainer``; the step is then cut into its phases, each compiled on its own
and timed (median of --repeats runs after a warm-up run):

  forward     per tower: the model and the loss on its shard
  backward    per tower: (forward + gradient) minus forward
  all-reduce  every gradient through --algorithm, as the trainer runs it
  apply       per replica: the optimizer's update

and laid out as the step orders them: the towers start together, the reduction
starts when the slowest tower's backward ends, its ticks follow one another, and
the apply follows. Each tick's events sit on the towers that send or receive in
it (args list the transfers, summed over variables).

What the numbers mean: forward, backward, apply and the whole all-reduce are
measured; a tick's length is the all-reduce's measured time split over its ticks
in proportion to the bytes each moves (the ticks of one compiled all-reduce are
not timed one by one), so tick lengths are a model, and all positions are
derived. The whole compiled step is measured too (its own row) and differs from
the laid-out phases: pieces compiled apart each pay a call's overhead and cannot
overlap; the whole step runs its towers side by side on the host's shared cores
(a tower timed alone runs faster) and does work the pieces leave out (reading
the weights onto the towers, summing the loss).

Every tower gets a process (pid) with a "compute" and an "all-reduce" thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["EPILOG", "add_arguments", "build_timeline", "run", "validate"]

EPILOG = """examples:
  python -m towers timeline                                  # 4 towers, ring
  python -m towers timeline --towers 8 --algorithm tree --out tree_step.json
  python -m towers timeline --variables parameter_device --algorithm naive
  python -m towers timeline --algorithm my_algos:star --repeats 20

Open the JSON at https://ui.perfetto.dev (Open trace file) or in chrome://tracing.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``towers timeline``."""
    parser.add_argument("--towers", type=int, default=4, help="simulated devices (default 4)")
    parser.add_argument("--algorithm", default="ring",
                        help="a registered name (default ring) or module:function")
    parser.add_argument("--variables", default="replicated",
                        choices=("replicated", "parameter_device"),
                        help="variable placement (default replicated)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (default 64)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per phase; the median is used (default 5)")
    parser.add_argument("--out", default="timeline.json", help="output (default timeline.json)")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and the batch")


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
    shards: list[tuple[Any, Any]]
    batch: tuple[Any, Any]


def _setup(args: argparse.Namespace, devices: list[str]) -> _Setup:
    import keras
    import tensorflow as tf

    import towers
    from towers.split import shard_sizes
    from towers.trace.schedule import load_algorithm
    from towers.training.data import digits
    from towers.training.models import digits_cnn

    # Registry names go to the trainer as names ("parameter_device" means its device).
    algorithm = args.algorithm
    if ":" in algorithm:
        algorithm = load_algorithm(algorithm, devices)[1]
    x, y, _, _ = digits(seed=args.seed)
    x, y = x[: args.batch_size], y[: args.batch_size]
    trainer = towers.TowerTrainer(
        lambda: digits_cnn(args.seed),
        lambda: keras.optimizers.SGD(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=devices, all_reduce=algorithm, variables=args.variables,
    )
    shards, start = [], 0
    for size, device in zip(shard_sizes(len(x), len(devices)), devices):
        with tf.device(device):
            part = slice(start, start + size)
            shards.append((tf.constant(x[part]), tf.constant(y[part])))
        start += size
    return _Setup(trainer, shards, (x, y))


def _tower_fns(setup: _Setup, tower: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Compiled forward and forward+backward of one tower, on copies of its weights."""
    import tensorflow as tf

    from towers.tower import per_example_loss, tower_step

    trainer, (x, y) = setup.trainer, setup.shards[tower]
    device, n, batch = trainer.devices[tower], len(trainer.devices), len(setup.batch[0])
    replica = trainer.replicas[0 if len(trainer.replicas) == 1 else tower]
    model = replica.model
    with tf.device(device):
        trainable = [tf.identity(v.value) for v in model.trainable_variables]
        frozen = [tf.identity(v.value) for v in model.non_trainable_variables]

    @tf.function(autograph=False)
    def forward() -> tf.Tensor:
        with tf.device(device):
            y_pred, _ = model.stateless_call(trainable, frozen, x, training=True)
            per_ex = per_example_loss(trainer.loss_fn, y, y_pred)
            return tf.nn.compute_average_loss(per_ex, global_batch_size=batch)

    @tf.function(autograph=False)
    def forward_backward() -> list[tf.Tensor]:
        result = tower_step(model, trainable, frozen, (x, y, None), loss_fn=trainer.loss_fn,
                            global_batch=tf.constant(batch), num_towers=n, device=device)
        return list(result.grads)

    return forward, forward_backward


def _reduce_fn(trainer: Any, grads: list[list[Any]], groups: list[list[Any]]) -> Callable[[], Any]:
    """The compiled all-reduce of every gradient; ``groups`` receives the recorded transfers."""
    import tensorflow as tf

    from towers.allreduce.base import GradientReducer
    from towers.allreduce.primitives import record

    algorithm, devices = trainer.algorithm, trainer.devices

    @tf.function(autograph=False)
    def reduce(flat: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
        placed = []
        for device, row in zip(devices, flat):
            with tf.device(device):
                placed.append([tf.identity(g) for g in row])
        groups.clear()
        if isinstance(algorithm, GradientReducer):
            with record() as rec:
                out = algorithm.reduce_gradients(placed)
            groups.append(list(rec.transfers))
            return out
        per_var = []
        for j in range(len(placed[0])):
            with record() as rec:
                per_var.append(algorithm([row[j] for row in placed], op="sum"))
            groups.append(list(rec.transfers))
        return [[outs[i] for outs in per_var] for i in range(len(devices))]

    return lambda: reduce(grads)


def _apply_fn(replica: Any, grads: Sequence[Any]) -> Callable[[], Any]:
    import tensorflow as tf

    with tf.device(replica.device):
        grads = [tf.identity(g) for g in grads]

    @tf.function(autograph=False)
    def apply() -> tf.Tensor:
        with tf.device(replica.device):
            replica.optimizer.apply_gradients(zip(grads, replica.model.trainable_variables))
            return tf.constant(0)

    return apply


class _Phases(NamedTuple):
    forward: list[float]  # seconds, per tower
    backward: list[float]
    reduce: float
    apply: list[float]  # per replica
    step: float
    groups: list[tuple[int, list[Any]]]  # per all-reduce call: (bytes per tower, transfers)


def _measure(setup: _Setup, repeats: int, bar: Any) -> _Phases:
    trainer = setup.trainer
    forward, backward, grads = [], [], []
    for tower in range(len(trainer.devices)):
        fwd, fwd_bwd = _tower_fns(setup, tower)
        forward.append(_median_seconds(fwd, repeats))
        backward.append(max(_median_seconds(fwd_bwd, repeats) - forward[-1], 0.0))
        grads.append(fwd_bwd())
        bar.add(1)
    recorded: list[list[Any]] = []
    reduce = _reduce_fn(trainer, grads, recorded)
    reduce_time = _median_seconds(reduce, repeats)
    reduced = reduce()
    bar.add(1)
    apply = []
    for k, replica in enumerate(trainer.replicas):
        apply.append(_median_seconds(_apply_fn(replica, reduced[k]), repeats))
        bar.add(1)
    step = _median_seconds(lambda: trainer.train_step(*setup.batch), repeats)
    bar.add(1)
    sizes = [int(g.shape.num_elements()) * g.dtype.size for g in grads[0]]
    if len(recorded) == 1 and len(sizes) > 1:  # a GradientReducer: one call for all
        sizes = [sum(sizes)]
    return _Phases(forward, backward, reduce_time, apply, step, list(zip(sizes, recorded)))


# -- laying out ---------------------------------------------------------------------------------


def _places(devices: Sequence[str], groups: list[tuple[int, list[Any]]]) -> list[str]:
    places = list(devices)
    for _, transfers in groups:
        for t in transfers:
            places += [d for d in (t.src, t.dst) if d not in places]
    return places


def _ticks(groups: list[tuple[int, list[Any]]], places: list[str]) -> dict[int, dict[str, Any]]:
    """Per tick, summed over every all-reduce call: bytes, and per place what it sent/got."""
    from towers.trace.schedule import assign_ticks

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
    homes = [places.index(r.device) for r in trainer.replicas]
    for home, seconds in zip(homes, phases.apply):
        events.append(_x("apply", home, 0, start + phases.reduce, seconds))
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
    lines.append(f"{'apply (per replica)':<28}" + "".join(f"{v * ms:>10.3f}" for v in phases.apply))
    laid_out = max(f + b for f, b in zip(phases.forward, phases.backward))
    laid_out += phases.reduce + max(phases.apply)
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

    from towers.allreduce.ordering import as_written

    setup = _setup(args, devices)
    bar = keras.utils.Progbar(len(devices) + len(setup.trainer.replicas) + 2, unit_name="phase")
    with as_written():
        phases = _measure(setup, args.repeats, bar)
    events, ticks = _events(setup.trainer, phases)
    other = {"algorithm": args.algorithm, "towers": len(devices), "ticks": ticks,
             "variables": args.variables, "batch": args.batch_size, "timings": _meaning()}
    data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    return data, _report(phases, len(devices), ticks, args.repeats)


def run(args: argparse.Namespace) -> int:
    """Run the job; returns a process exit code."""
    if args.towers < 1 or args.repeats < 1 or args.batch_size < args.towers:
        print("towers timeline: error: need --towers >= 1, --repeats >= 1 and a batch with at "
              "least one example per tower", file=sys.stderr)
        return 2
    from towers.trace.schedule import start_devices

    devices = start_devices(args.towers)  # first thing: before TensorFlow's runtime starts
    print(f"towers timeline: one step of digits_cnn, batch {args.batch_size}, {args.towers} "
          f"towers, all_reduce={args.algorithm}, variables={args.variables}")
    try:
        data, report = build_timeline(args, devices)
    except (ValueError, TypeError) as err:  # an unknown algorithm, a bad model/batch
        print(f"towers timeline: error: {err}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    with open(args.out) as f:
        validate(json.load(f), args.towers, data["otherData"]["ticks"])
    print(report)
    count = sum(e["ph"] == "X" for e in data["traceEvents"])
    print(f"wrote {args.out}: {count} events (open at https://ui.perfetto.dev or chrome://tracing)")
    return 0
