"""The all-reduce table: every algorithm and tf.distribute's cross-device ops, side by side.

nccl-tests' columns (``algbw = S / t``, ``busbw = algbw · 2(n−1)/n``). The inputs are small
integers in float32, so every summation order is exact and ``#wrong`` counts the output
elements that differ from NumPy's sum. ``send`` and ``add`` rows calibrate the cost model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from reference.mirrored import collective_all_reduce
from towers import allreduce
from towers.allreduce.machinery.base import as_written
from towers.bench import costmodel, report
from towers.bench.report import Samples, interleave, num, text
from towers.devices import canonical_device

__all__ = ["QUICK_SIZES", "SIZES", "Contender", "compiled", "contenders", "count_wrong",
           "make_inputs", "run_allreduce", "section", "table", "towers_contender"]

SIZES = tuple(4096 * 4**k for k in range(8))  # bytes per tower: 4 KB, 16 KB, … 64 MB
QUICK_SIZES = SIZES[:5]  # 4 KB … 1 MB, for --quick


@dataclasses.dataclass(frozen=True)
class Contender:
    """One row kind of the table: ``body`` maps placed per-tower tensors to outputs."""

    name: str
    kind: str  # "towers", "tf.distribute" or "calibration"
    body: Callable[[list[tf.Tensor]], list[tf.Tensor]]
    formula: str | None = None  # the cost model's name for it (None: not modelled)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the formula's
    outputs: str = "all"  # one sum per tower; "sum": one sum; "copy": input 1


def towers_contender(name: str) -> Contender:
    """A registered towers algorithm, with its cost formula's parameters."""
    algorithm = allreduce.get(name)
    cost = allreduce.ALGORITHMS[name].cost
    formula, params = None, {}
    if cost is not None:  # only what the formula takes: run-time settings cost nothing
        accepted = inspect.signature(cost).parameters
        params = {k: v for k, v in dict(getattr(algorithm, "params", {})).items()
                  if k in accepted and k not in ("n", "nbytes")}
        named = all(isinstance(params.get(k), str) for k in ("inner", "outer"))
        formula = None if name == "hierarchical" and not named else name

    return Contender(name, "towers", lambda values: list(algorithm(values, op="sum")),
                     formula=formula, params=params)


def _tf_contender(name: str, ops: tf.distribute.CrossDeviceOps, formula: str) -> Contender:
    def body(values: list[tf.Tensor]) -> list[tf.Tensor]:
        per_replica = values_lib.PerReplica(values)
        mirrored = ops.reduce(tf.distribute.ReduceOp.SUM, per_replica, destinations=per_replica)
        return list(mirrored.values)

    return Contender(name, "tf.distribute", body, formula=formula)


def _add(values: list[tf.Tensor]) -> list[tf.Tensor]:
    with tf.device(values[0].device):
        return [tf.add_n(values)]


def contenders(devices: Sequence[str], algorithms: Sequence[str] | None = None) -> list[Contender]:
    """Towers' ``algorithms`` (default: all; ``tf.*`` names MirroredStrategy's ops) and the
    calibration pair."""
    tf_ops = {"tf.CollectiveAllReduce": (collective_all_reduce(list(devices)), "ring"),
              "tf.ReductionToOneDevice": (tf.distribute.ReductionToOneDevice(), "naive")}
    names = list(allreduce.ALGORITHMS) + list(tf_ops) if algorithms is None else algorithms
    out = [_tf_contender(name, *tf_ops[name]) if name in tf_ops else towers_contender(name)
           for name in names]
    if len(devices) < 2:
        return out
    return [*out, Contender("send", "calibration", lambda v: [allreduce.send(v[1], v[0].device)],
                            formula="send", outputs="copy"),
            Contender("add", "calibration", _add, formula="add", outputs="sum")]


def _on(device: str, value: Any) -> tf.Tensor:
    with tf.device(device):
        return tf.identity(value)


def make_inputs(devices: Sequence[str], nbytes: int, seed: int = 0) -> list[tf.Tensor]:
    """One float32 tensor of ``nbytes`` per device, holding integers in [-64, 64]."""
    rng = np.random.default_rng(seed)
    return [_on(d, rng.integers(-64, 65, size=nbytes // 4).astype(np.float32)) for d in devices]


def compiled(contender: Contender, devices: Sequence[str]) -> tuple[Callable[..., Any], list[str]]:
    """``contender`` compiled for ``devices``, and its outputs' devices (set when traced)."""
    homes: list[str] = []

    def placed(*values: tf.Tensor) -> list[tf.Tensor]:
        outputs = contender.body([_on(d, v) for v, d in zip(values, devices)])
        homes[:] = [canonical_device(o.device) for o in outputs]
        return outputs

    return tf.function(placed, autograph=False), homes


def count_wrong(
    contender: Contender, outputs: Sequence[tf.Tensor], inputs: Sequence[np.ndarray],
    devices: Sequence[str], homes: Sequence[str],
) -> int:
    """Elements that differ from the exact answer, over all outputs (misplaced: all wrong)."""
    total = np.sum(inputs, axis=0)  # exact: small integers in float32
    expected = {"copy": [inputs[1]], "sum": [total]}.get(contender.outputs,
                                                         [total] * len(devices))
    if len(outputs) != len(expected) or len(homes) != len(expected):
        return int(sum(e.size for e in expected))
    return sum(want.size if canonical_device(home) != canonical_device(should)
               else int(np.count_nonzero(out.numpy().reshape(-1) != want))
               for out, want, home, should in zip(outputs, expected, homes, devices))


def _row(contender: Contender, n: int, nbytes: int, samples: Samples | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "size": nbytes, "count": nbytes // 4, "type": "float", "redop": "sum",
        "algorithm": contender.name, "kind": contender.kind, "n": n,
        "formula": contender.formula, "params": dict(contender.params),
        **dict.fromkeys(("time_us", "min_us", "cpu_us", "algbw", "busbw", "wrong")), "error": "",
    }
    if samples is not None:
        seconds = samples.median
        row.update(time_us=seconds * 1e6, min_us=samples.minimum * 1e6,
                   cpu_us=samples.cpu_median * 1e6, algbw=costmodel.algbw(nbytes, seconds) / 1e9,
                   busbw=costmodel.busbw(nbytes, seconds, n) / 1e9
                   if contender.kind != "calibration" else None)
    return row


def run_allreduce(
    devices: Sequence[str], sizes: Sequence[int] = SIZES, *,
    algorithms: Sequence[str] | None = None, rounds: int = 15, verbose: bool = False,
) -> list[dict[str, Any]]:
    """Every contender at every size, timed in one interleaved loop; #wrong from a fresh call."""
    if any(nbytes % 4 for nbytes in sizes):
        raise ValueError(f"sizes must be multiples of 4 bytes (float32), got {list(sizes)}")
    cands = contenders(devices, algorithms)
    with as_written():
        inputs = {s: make_inputs(devices, s, seed=s) for s in sizes}
        built: dict[str, tuple[Callable[..., Any], list[str]]] = {}
        errors: dict[str, str] = {}
        calls: dict[str, Callable[[], Any]] = {}
        for key, s, c in ((f"{s}|{c.name}", s, c) for s in sizes for c in cands):
            try:  # traced once; a contender that cannot run here gets a row saying why
                built[key] = compiled(c, devices)
                built[key][0](*inputs[s])
                calls[key] = functools.partial(built[key][0], *inputs[s])
            except Exception as err:
                built.pop(key, None)
                errors[key] = report.reason(err)
        samples = interleave(calls, rounds, warmup=3, verbose=verbose,  # 3 calls a sample to 256 KB
                             calls={k: 3 if int(k.split("|")[0]) <= 1 << 18 else 1 for k in calls},
                             label=f"all-reduce: {len(calls)} (size, algorithm) pairs")
        rows = []
        for s in sizes:
            host = [x.numpy() for x in inputs[s]]
            for c in cands:
                key = f"{s}|{c.name}"
                row = _row(c, len(devices), s, samples.get(key))
                if key in built:
                    fn, homes = built[key]
                    row["wrong"] = count_wrong(c, fn(*inputs[s]), host, devices, homes)
                rows.append({**row, "error": errors.get(key, "")})
        return rows


COLUMNS: list[report.Column] = [
    ("size\n(B)", "r", num("size", "d")), ("count\n(elements)", "r", num("count", "d")),
    ("type\n", "r", text("type")), ("redop\n", "r", text("redop")),
    ("algorithm\n", "l", text("algorithm")), ("time\n(us)", "r", num("time_us", ".1f")),
    ("algbw\n(GB/s)", "r", num("algbw", ".3f")), ("busbw\n(GB/s)", "r", num("busbw", ".3f")),
    ("#wrong\n", "r", num("wrong", "d")), ("min\n(us)", "r", num("min_us", ".1f")),
    ("cpu\n(us)", "r", num("cpu_us", ".1f")),
]


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The nccl-tests style table (calibration rows left out); failed contenders after."""
    shown = [r for r in rows if r.get("kind") != "calibration" and not r.get("error")]
    failed = {r["algorithm"]: r["error"] for r in rows if r.get("error")}
    return report.format_table(COLUMNS, shown) + "".join(
        f"\n# {k}: not run ({v})" for k, v in failed.items())


def plot(rows: Sequence[dict[str, Any]], path: Any, title: str) -> Any:
    """algbw against message size, one line per algorithm (log x; tf.distribute dashed)."""
    fig = report.figure(8, 5)
    ax = fig.add_subplot()
    shown = [r for r in rows if r.get("kind") != "calibration" and r.get("algbw")]
    for name in dict.fromkeys(r["algorithm"] for r in shown):
        mine = sorted((r["size"], r["algbw"]) for r in shown if r["algorithm"] == name)
        ax.plot(*zip(*mine), "--" if name.startswith("tf.") else "-", marker="o",
                markersize=3, label=name)
    ax.set(xscale="log", xlabel="bytes per tower", ylabel="algbw (GB/s)", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return report.save(fig, path)


def section(args: argparse.Namespace, devices: list[str], results: dict) -> bool:
    """``--sections allreduce``: the table, its CSV and plot; False if any #wrong."""
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    report.heading(f"all-reduce, {len(devices)} towers, float32 sum, {sizes[0]}..{sizes[-1]} B "
                   "per tower")
    rows = run_allreduce(devices, sizes, algorithms=args.algorithms,
                         rounds=args.rounds or (9 if args.quick else 15), verbose=not args.quiet)
    print(f"# time = median of interleaved rounds; busbw = algbw * 2(n-1)/n, n = {len(devices)}")
    report.publish(args, results, "allreduce", rows, table(rows), lambda out: plot(
        rows, out / "allreduce_algbw.png",
        f"all-reduce over {len(devices)} simulated devices (float32 sum)"))
    results["allreduce_load"] = os.getloadavg()
    wrong = [r for r in rows if r.get("wrong")]
    for r in wrong:
        print(f"WRONG: {r['algorithm']} at {r['size']} B: {r['wrong']} elements")
    return not wrong
