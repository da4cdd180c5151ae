"""Where a step's time goes: TensorFlow's profiler, summed per op type and per phase.

:func:`op_profile` runs a step a few times under ``tf.profiler.experimental`` and
reads the trace it writes (an XSpace protobuf): every op event on TensorFlow's
compute and collective threads is summed by op type. The result is *thread* time
per step, summed over threads, so on 2 cores it can be up to twice the wall time;
an op preempted by another process counts the time it waited.

Op types are grouped into phases by :func:`phase`: ``reduce`` (AddN, collectives,
the concat/split that packs buffers, cross-device sends), ``update`` (variable
assignment and fused optimizer kernels) and ``compute`` (everything else: forward,
backward, loss; SGD's ``lr·g`` multiply is a ``Mul`` and lands here too).
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["PHASES", "op_events", "op_profile", "phase", "profiled", "summarize"]

PHASES = ("compute", "reduce", "update")
_REDUCE = {
    "AddN", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGatherV2",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "NcclAllReduce",
    "ConcatV2", "SplitV", "Split", "_Send", "_Recv", "_HostSend", "_HostRecv",
}


def phase(op_type: str) -> str:
    """The phase an op type belongs to (see the module docstring)."""
    if op_type in _REDUCE:
        return "reduce"
    if op_type.startswith(("Assign", "ResourceApply", "ResourceSparseApply")):
        return "update"
    return "compute"


def _read_xspace(logdir: str) -> Any:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {logdir}")
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as f:
        space.ParseFromString(f.read())
    return space


def op_events(space: Any) -> collections.Counter[tuple[str, str]]:
    """Picoseconds per ``(op name, op type)``: events named ``op/name:OpType`` on
    TensorFlow's executor threads (not ``ExecutorState::Process`` and the like)."""
    total: collections.Counter[tuple[str, str]] = collections.Counter()
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not line.name.startswith(("tf_Compute", "collective_ops", "tf_inter_op")):
                continue
            for event in line.events:
                name = names.get(event.metadata_id, "")
                if ":" in name and "::" not in name:
                    op, kind = name.rsplit(":", 1)
                    total[(op, kind)] += event.duration_ps
    return total


def _op_times(space: Any) -> collections.Counter[str]:
    """Picoseconds per op type."""
    total: collections.Counter[str] = collections.Counter()
    for (_, kind), ps in op_events(space).items():
        total[kind] += ps
    return total


def profiled(step: Callable[[], Any], steps: int) -> tuple[Any, float]:
    """Run ``step`` ``steps`` times under the profiler: ``(the trace's XSpace, wall s/step)``."""
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall = (time.perf_counter() - start) / steps
        finally:
            tf.profiler.experimental.stop()
        return _read_xspace(logdir), wall


def op_profile(step: Callable[[], Any], steps: int = 5) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step`` (warm it up first).

    Returns:
        ``{"wall_ms": ms per step, "ops": {op_type: thread ms per step}, "phases":
        {phase: thread ms per step}}``.
    """
    space, wall = profiled(step, steps)
    times = _op_times(space)
    ops = {k: v / 1e9 / steps for k, v in times.most_common()}
    phases = dict.fromkeys(PHASES, 0.0)
    for k, ms in ops.items():
        phases[phase(k)] += ms
    return {"wall_ms": wall * 1e3, "ops": ops, "phases": phases}


def summarize(profile: dict[str, Any], top: int = 6) -> str:
    """One line: wall, thread time per phase (share), and the ``top`` op types."""
    total = sum(profile["phases"].values()) or 1.0
    phases = "  ".join(f"{k} {v:.1f} ms ({v / total:.0%})" for k, v in profile["phases"].items())
    ops = ", ".join(f"{k} {v:.1f}" for k, v in list(profile["ops"].items())[:top])
    return f"wall {profile['wall_ms']:.1f} ms; thread {total:.1f} ms: {phases}; top: {ops}"
