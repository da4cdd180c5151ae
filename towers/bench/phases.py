"""Where each millisecond of a step goes, phase by phase, from TensorFlow's profiler.

An op event counts for the innermost phase scope its name carries (``split``, ``guard``,
``reduce``, ``apply``, ``replica_<i>``); tf.distribute's unscoped ops count by type.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from towers.allreduce.machinery.base import scoped_tower
from towers.bench import report
from towers.bench.memory import CONFIGS
from towers.bench.training import MODELS, build_steps

__all__ = ["PHASES", "phase_of", "phase_profile", "run_phases", "section", "table"]

PHASES = ("split", "forward_backward", "handoff", "reduce", "apply", "guard")
_SCOPES = {"split": "split", "reduce": "reduce", "apply": "apply", "guard": "guard",
           "forward_backward": "handoff"}  # the update's arguments, pinned to the towers
_HANDOFF = re.compile(r"(Identity(_\d+)?|NoOp(_\d+)?|GroupCrossDeviceControlEdges_\d+"
                      r"|grads(_\d+)?|\w+_resource|unknown(_\d+)?)$")
_REDUCE_TYPES = {
    "AddN", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGatherV2",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "NcclAllReduce",
    "ConcatV2", "SplitV", "Split", "_Send", "_Recv", "_HostSend", "_HostRecv",
}


def phase_of(op_name: str, op_type: str = "", *, scoped: bool = True) -> tuple[str, int | None]:
    """The phase of one op event and its tower (forward_backward only).

    Example:
        >>> phase_of("gradient_tape/replica_2/dense/MatMul/MatMul"), phase_of("dense/Relu")
        (('forward_backward', 2), ('forward_backward', 0))
    """
    if not scoped:
        applies = op_type.startswith(("Assign", "ResourceApply", "ResourceSparseApply"))
        return ("reduce" if op_type in _REDUCE_TYPES else "apply" if applies
                else "forward_backward"), None
    if _HANDOFF.match(op_name.split("/")[0]):
        return "handoff", None
    tower = scoped_tower(op_name)
    if tower is not None:
        return "forward_backward", tower
    found = [_SCOPES[part] for part in op_name.split("/")[:-1] if part in _SCOPES]
    if found:  # the innermost wins: reduce/apply run inside the guard
        return found[-1], None
    return "forward_backward", 0  # no phase scope: tower 0's


def _op_events(logdir: str) -> collections.Counter[tuple[str, str]]:
    """Picoseconds per ``(op name, op type)`` on TensorFlow's executor threads."""
    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {logdir}")
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as f:
        space.ParseFromString(f.read())
    total: collections.Counter[tuple[str, str]] = collections.Counter()
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if line.name.startswith(("tf_Compute", "collective_ops", "tf_inter_op")):
                for event in line.events:
                    name = names.get(event.metadata_id, "")
                    if ":" in name and "::" not in name:  # "op/name:OpType", not the executor's
                        op, kind = name.rsplit(":", 1)
                        total[(op, kind)] += event.duration_ps
    return total


def phase_profile(step: Callable[[], Any], steps: int = 5, *, scoped: bool = True) -> dict:
    """Profile ``steps`` warmed-up calls of ``step``: ``wall_ms``, ``thread_ms``, ms per phase
    (``phases``) and per tower (``towers``)."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - start) / steps
        finally:
            tf.profiler.experimental.stop()
        events = _op_events(logdir)
    phases = dict.fromkeys(PHASES, 0.0)
    towers: dict[int, float] = collections.defaultdict(float)
    for (op, kind), ps in events.items():
        name, tower = phase_of(op, kind, scoped=scoped)
        phases[name] += ps / 1e9 / steps
        if tower is not None:
            towers[tower] += ps / 1e9 / steps
    return {"wall_ms": wall * 1e3, "phases": phases, "towers": dict(sorted(towers.items())),
            "thread_ms": sum(phases.values())}


def run_phases(model: str, devices: Sequence[str], names: Sequence[str], *, batch: int = 256,
               steps: int = 5, verbose: bool = False) -> list[dict[str, Any]]:
    """One row per configuration (``towers <algo>/<placement>`` or a tf.distribute name)."""
    rows = []
    for name, step in build_steps(model, devices, names, batch)[0].items():
        step()  # trace and warm up outside the profile
        profile = phase_profile(step, steps, scoped=name.startswith("towers "))
        rows.append({"model": model, "config": name, "wall_ms": profile["wall_ms"],
                     "thread_ms": profile["thread_ms"], **profile["phases"],
                     "towers_ms": " ".join(f"{v:.2f}" for v in profile["towers"].values())})
        if verbose:
            print(f"  {name}: wall {rows[-1]['wall_ms']:.1f} ms", flush=True)
    return rows


def _share(phase: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: f"{row[phase]:.1f} {row[phase] / (row['thread_ms'] or 1):4.0%}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Wall ms and thread ms per phase (with its share), one row per configuration."""
    columns: list[report.Column] = [("model\n", "l", report.text("model")),
                                    ("config\n", "l", report.text("config")),
                                    ("wall\n(ms)", "r", report.num("wall_ms", ".1f"))]
    columns += [(f"{p}\n(ms, %)", "r", _share(p)) for p in PHASES]
    return report.format_table(columns, rows)


def plot(rows: Sequence[dict[str, Any]], path: Any) -> Any:
    """Stacked horizontal bars: thread ms per phase, one bar per configuration."""
    fig = report.figure(9, 1.6 + 0.35 * len(rows))
    ax = fig.add_subplot()
    labels = [f"{r['model']}: {r['config']}" for r in rows]
    left = [0.0] * len(rows)
    for p in PHASES:
        ax.barh(labels, [r[p] for r in rows], left=left, label=p)
        left = [a + r[p] for a, r in zip(left, rows)]
    ax.plot([r["wall_ms"] for r in rows], labels, "k|", markersize=14, label="wall")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set(xlabel="thread ms per step (| = wall ms)",
           title="where a step's time goes (TensorFlow profiler)")
    ax.legend(fontsize=7, ncol=4)
    return report.save(fig, path)


DEFAULT_CONFIGS = (*CONFIGS, "towers noop/replicated")


def section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``--sections phases``: the breakdown table, its CSV and its PNG."""
    rows = []
    picks = [c for c in DEFAULT_CONFIGS if not c.startswith("towers ") or not args.placements
             or c.rsplit("/", 1)[1] in args.placements]
    for model in args.models or list(MODELS):
        report.heading(f"phases: {model}, batch {args.batch_size}, {len(devices)} towers "
                       "(profiler)")
        timed = [r for r in results.get("training", [])
                 if r["model"] == model and r.get("ms") and r["kind"] == "towers"]
        best = [min(timed, key=lambda r: r["ms"])["config"]] if timed else []
        names = picks[:2] + [c for c in best if c not in picks] + picks[2:]
        rows += run_phases(model, devices, names, batch=args.batch_size, verbose=not args.quiet)
    print("thread ms per step by phase (share of the step's thread time); wall = elapsed:")
    report.publish(args, results, "phases", rows, table(rows),
                   lambda out: plot(rows, out / "phases.png"))
    return True
