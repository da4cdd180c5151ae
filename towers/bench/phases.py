"""Where each millisecond of a step goes, phase by phase, from TensorFlow's profiler.

The towers step names its phases with ``tf.name_scope`` (``split``, ``guard``, and inside
the guard's ``tf.cond`` ``reduce`` and ``apply``; :mod:`towers.step`). Its towers carry
``MirroredStrategy``'s replica names, because Grappler's rewrites read node names
(:func:`~towers.allreduce.machinery.ordering.replica_scope`): tower ``i > 0`` under
``replica_<i>``, tower 0 under no scope of its own, so an op outside every phase scope
is tower 0's. :func:`phase_profile` runs a step under
``tf.profiler.experimental`` and sums every op event of the trace (an XSpace) by
the phase its op name carries::

    split/strided_slice_3:StridedSlice                      -> split
    gradient_tape/replica_2/dense_1/MatMul/MatMul:_MklMatMul  -> forward_backward (tower 2)
    gradient_tape/dense_1/MatMul/MatMul:_MklMatMul          -> forward_backward (tower 0)
    guard/cond/then/_0/guard/cond/reduce/concat:ConcatV2    -> reduce (innermost scope)
    guard/cond/then/_0/guard/cond/apply/sgd_3/...           -> apply
    guard/IsFinite_11:IsFinite                              -> guard (the non-finite check)

A ``_Send``/``_Recv`` is named after the op whose value it carries, so it lands in
that op's phase. Under ``forward_graph="default"`` the reduction and update are a nested
function (:class:`~towers.compile.step.PhasedStep`); the ops at its
boundary (its arguments: gradients and the variables' handles, captured ``unknown``
ones too; cross-device control edges, top-level ``Identity`` and ``NoOp`` s) are the
``handoff``::

    Identity_10/_61:_Recv                                   -> handoff
    grads_14/_3:_Recv                 (the update's argument) -> handoff
    replica_1_readvariableop_resource/_39:_Send (a handle)  -> handoff
    forward_backward/Identity_11/_113:_Send (an argument back on its tower) -> handoff
    GroupCrossDeviceControlEdges_0/NoOp:NoOp                -> handoff

tf.distribute steps carry no such scopes: their ops are
attributed by type (:func:`towers.bench.profile.phase`: compute ->
forward_backward, reduce -> reduce, update -> apply) and the split is invisible
(it happens in the input pipeline), so read their bars as a rougher picture.

The figures are *thread* time per step summed over TensorFlow's threads (on 2
cores up to twice the wall time, and a preempted op counts its wait), next to the
step's wall time. Nothing here times anything with hand-inserted timers.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from towers.allreduce.machinery.ordering import scoped_tower
from towers.bench import report
from towers.bench.profile import op_events, profiled
from towers.bench.profile import phase as op_type_phase
from towers.bench.timing import load_average
from towers.bench.training import MODELS, profile_steps

__all__ = ["PHASES", "phase_of", "phase_profile", "phase_table", "plot_phases", "run_phases"]

PHASES = ("split", "forward_backward", "handoff", "reduce", "apply", "guard")
_SCOPES = {"split": "split", "reduce": "reduce", "apply": "apply", "guard": "guard",
           "forward_backward": "handoff"}  # the update's arguments, pinned to the towers
_HANDOFF = re.compile(r"(Identity(_\d+)?|NoOp(_\d+)?|GroupCrossDeviceControlEdges_\d+"
                      r"|grads(_\d+)?|\w+_resource|unknown(_\d+)?)$")
_BY_TYPE = {"compute": "forward_backward", "reduce": "reduce", "update": "apply"}


def phase_of(op_name: str, op_type: str = "", *, scoped: bool = True) -> tuple[str, int | None]:
    """The phase of one op event (and its tower for forward_backward, else None).

    Args:
        op_name: the op's full name (name scopes included).
        op_type: its type, used when ``scoped`` is False or no scope matches.
        scoped: whether the step names its phases (towers' step does; tf.distribute's not).

    Example:
        >>> phase_of("gradient_tape/replica_2/dense/MatMul/MatMul"), phase_of("dense/Relu")
        (('forward_backward', 2), ('forward_backward', 0))
    """
    if scoped:
        if _HANDOFF.match(op_name.split("/")[0]):
            return "handoff", None
        tower = scoped_tower(op_name)
        if tower is not None:
            return "forward_backward", tower
        found = [_SCOPES[part] for part in op_name.split("/")[:-1] if part in _SCOPES]
        if found:  # the innermost wins: reduce/apply run inside the guard
            return found[-1], None
        return "forward_backward", 0  # no phase scope: tower 0's (replica_scope)
    return _BY_TYPE[op_type_phase(op_type)], None


def phase_profile(step: Callable[[], Any], steps: int = 5, *, scoped: bool = True) -> dict:
    """Profile ``steps`` calls of ``step`` (warm it up first) and split the time by phase.

    Returns:
        ``{"wall_ms": wall ms per step, "phases": {phase: thread ms per step},
        "towers": {tower: thread ms per step of its forward_backward}, "thread_ms": total}``.
    """
    space, wall = profiled(step, steps)
    events = op_events(space)
    phases = dict.fromkeys(PHASES, 0.0)
    towers: dict[int, float] = collections.defaultdict(float)
    for (op, kind), ps in events.items():
        name, tower = phase_of(op, kind, scoped=scoped)
        ms = ps / 1e9 / steps
        phases[name] += ms
        if tower is not None:
            towers[tower] += ms
    return {"wall_ms": wall * 1e3, "phases": phases, "towers": dict(sorted(towers.items())),
            "thread_ms": sum(phases.values())}


def run_phases(
    model: str, devices: Sequence[str], names: Sequence[str], *, batch: int = 256,
    steps: int = 5, verbose: bool = False,
) -> list[dict[str, Any]]:
    """One row per configuration (``towers <algo>/<placement>`` or a tf.distribute name)."""
    rows = []
    for name, step in profile_steps(model, devices, names, batch=batch).items():
        step()  # trace and warm up outside the profile
        profile = phase_profile(step, steps, scoped=name.startswith("towers "))
        row = {"model": model, "config": name, "wall_ms": profile["wall_ms"],
               "thread_ms": profile["thread_ms"], **profile["phases"],
               "towers_ms": " ".join(f"{v:.2f}" for v in profile["towers"].values())}
        rows.append(row)
        if verbose:
            print(f"  {name}: wall {row['wall_ms']:.1f} ms", flush=True)
    return rows


def phase_table(rows: Sequence[dict[str, Any]]) -> str:
    """Wall ms and thread ms per phase (with its share), one row per configuration."""
    columns: list[report.Column] = [("model\n", "l", lambda r: r["model"]),
                                    ("config\n", "l", lambda r: r["config"]),
                                    ("wall\n(ms)", "r", lambda r: f"{r['wall_ms']:.1f}")]
    columns += [(f"{p}\n(ms, %)", "r", functools.partial(_share, phase=p)) for p in PHASES]
    return report.format_table(columns, list(rows))


def _share(row: dict[str, Any], phase: str) -> str:
    total = row["thread_ms"] or 1.0
    return f"{row[phase]:.1f} {row[phase] / total:4.0%}"


def plot_phases(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Stacked horizontal bars: thread ms per phase, one bar per configuration."""
    fig = report._figure(9, 1.6 + 0.35 * len(rows))
    ax = fig.add_subplot()
    labels = [f"{r['model']}: {r['config']}" for r in rows]
    left = [0.0] * len(rows)
    for p in PHASES:
        values = [r[p] for r in rows]
        ax.barh(labels, values, left=left, label=p)
        left = [a + b for a, b in zip(left, values)]
    ax.plot([r["wall_ms"] for r in rows], labels, "k|", markersize=14, label="wall")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.set(xlabel="thread ms per step (| = wall ms)",
           title=title or "where a step's time goes (TensorFlow profiler)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


DEFAULT_CONFIGS = (
    "MirroredStrategy", "CentralStorageStrategy", "towers naive/parameter_device",
    "towers ring/replicated", "towers noop/replicated",
)
"""Profiled when the training table did not run (else its fastest towers row joins these)."""


def _picks(results: dict[str, Any], model: str, placements: Sequence[str] | None) -> list[str]:
    """The tf.distribute defaults, the towers defaults (in ``placements``) and the fastest
    towers row of the training table when it ran."""
    rows = [r for r in results.get("training", []) if r["model"] == model and r.get("ms")]
    best = min((r for r in rows if r["kind"] == "towers"), key=lambda r: r["ms"], default=None)
    picks = [c for c in DEFAULT_CONFIGS
             if not c.startswith("towers ") or not placements or c.rsplit("/", 1)[1] in placements]
    if best is not None and best["config"] not in picks:
        picks.insert(2, best["config"])
    return picks


def phases_section(args: Any, devices: list[str], results: dict) -> bool:
    """``towers bench --sections phases``: the breakdown table, its CSV and its PNG."""
    tables = devices[: args.towers]
    rows: list[dict[str, Any]] = []
    for model in args.models or list(MODELS):
        load = ", ".join(f"{v:.2f}" for v in load_average())
        print(f"\n== phases: {model}, batch {args.batch_size}, {len(tables)} towers "
              f"(profiler; load average {load})", flush=True)
        picks = _picks(results, model, getattr(args, "placements", None))
        rows += run_phases(model, tables, picks, batch=args.batch_size,
                           verbose=not args.quiet)
    print("thread ms per step by phase (share of the step's thread time); wall = elapsed:")
    print(phase_table(rows))
    results["phases"] = rows
    report.write_csv(args.out / "phases.csv", rows)
    if not args.no_plots:
        plot_phases(rows, args.out / "phases.png")
    return True
