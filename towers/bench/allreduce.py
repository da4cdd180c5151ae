"""The all-reduce table: every algorithm and tf.distribute's cross-device ops, side by side.

For each message size (bytes per tower) every contender is compiled once in its
own ``tf.function`` and warmed up; then every (size, contender) pair is timed in
one interleaved loop (see :mod:`towers.bench.timing`), all inside one
:func:`towers.allreduce.machinery.ordering.as_written` block. tf.distribute's ops run there too:
the two Grappler passes it switches off rewrite chains of arithmetic, and a lone
collective or ``add_n`` has none, while switching the process-wide options
between calls would cost every call ~0.2-0.4 ms (the cached function-call
options are rebuilt). The rows follow nccl-tests::

    size  count  type  redop  algorithm  time (µs)  algbw (GB/s)  busbw (GB/s)  #wrong

``algbw = S / t`` and ``busbw = algbw · 2(n−1)/n`` (:func:`towers.bench.costmodel.busbw`).
The inputs are small integers stored as float32, so every summation order gives
the exact sum and ``#wrong`` counts, over all ``n`` outputs, the elements that
differ from NumPy's sum (an output on the wrong device counts all its elements).

Calibration contenders run beside them: ``send`` (one copy of ``S`` bytes
between towers: on logical CPUs a pointer passes, so this is the call overhead),
``add`` (``add_n`` of the ``n`` inputs on one device: the arithmetic), and the
parts every chunked schedule (``chunked`` rows) must run on one host, whatever its
schedule: its ``n(n-1)`` two-input additions of ``S/n`` bytes, timed as a tree's leaves
(``leaf adds``: each writes a new buffer) and as a ring's chain (``chain adds``: each
but the first writes into its partial), and ``assembly`` (the ``S``-byte output written
from the ``n`` finished chunks: once, shared by the towers on one memory;
:mod:`towers.bench.floors`). A chunked row's ``leaf_share`` places it between the two. They are not
all-reduces and stay out of the table (they are in the CSV); ``towers.bench.targets``
sets the chunked rows beside them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from towers import allreduce
from towers.allreduce.machinery.ordering import as_written
from towers.allreduce.machinery.scheduled import generator_of
from towers.bench import costmodel
from towers.bench.floors import (
    ASSEMBLY,
    CHAIN_ADDS,
    LEAF_ADDS,
    assembly,
    chain_adds,
    leaf_adds,
    leaf_share,
)
from towers.bench.onepass import ONE_PASS, OnePass
from towers.bench.timing import Samples, interleave
from towers.devices import canonical_device
from towers.schedule.ir import Schedule

__all__ = [
    "QUICK_SIZES",
    "SIZES",
    "Compiled",
    "Contender",
    "calls_per_sample",
    "contenders",
    "cost_rows",
    "count_wrong",
    "make_inputs",
    "run_allreduce",
    "towers_contender",
]

SIZES = tuple(4096 * 4**k for k in range(8))
"""Bytes per tower: 4 KB, 16 KB, … 64 MB (×4 steps)."""
QUICK_SIZES = SIZES[:5]
"""4 KB … 1 MB, for ``--quick``."""

Body = Callable[[list[tf.Tensor]], list[tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class Contender:
    """One row kind of the table: how to build its body and what it should return.

    Attributes:
        name: the algorithm column.
        kind: ``"towers"``, ``"tf.distribute"`` or ``"calibration"``.
        body: per-tower tensors (already placed) -> outputs; traced in a ``tf.function``.
        formula: the :mod:`towers.bench.costmodel` algorithm that models it (None: none does).
        params: keyword parameters for that formula.
        outputs: ``"all"`` (one sum per tower), ``"sum"`` (one sum), ``"copy"`` (input 1)
            or ``"parts"`` (a calibration's pieces: not compared).
        chunked: a bandwidth-optimal schedule of ``S/n`` chunks (ring, swing, …).
        schedule: its schedule generator, for its rows' ``leaf_share``
            (:func:`towers.bench.floors.leaf_share`; None: not a chunked schedule).
    """

    name: str
    kind: str
    body: Body
    formula: str | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    outputs: str = "all"
    chunked: bool = False
    schedule: Callable[[int], Schedule] | None = None


def _formula_params(name: str, fn: Any) -> tuple[str | None, dict[str, Any]]:
    """The cost-model formula and parameters of a registered algorithm (None if unmodelled)."""
    if name not in costmodel.ALGORITHMS:
        return None, {}
    params = dict(getattr(fn, "params", {}))
    # Only what the formula takes: run-time settings (a collective's timeout) cost nothing.
    cost = allreduce.ALGORITHMS[name].cost
    accepted = inspect.signature(cost).parameters if cost is not None else {}
    params = {k: v for k, v in params.items() if k in accepted and k not in ("n", "nbytes")}
    named = all(isinstance(params.get(k), str) for k in ("inner", "outer"))
    if name == "hierarchical" and not named:
        return None, {}  # a hand-made inner/outer algorithm has no formula by name
    return name, params


def towers_contender(name: str, fn: allreduce.AllReduce | None = None) -> Contender:
    """A towers algorithm, by registry name (or ``fn`` under that name)."""
    algorithm = fn if fn is not None else allreduce.get(name)
    formula, params = _formula_params(name, algorithm)

    def body(values: list[tf.Tensor]) -> list[tf.Tensor]:
        return list(algorithm(values, op="sum"))

    chunked = _chunked(algorithm)
    return Contender(name, "towers", body, formula=formula, params=params, chunked=chunked,
                     schedule=generator_of(algorithm) if chunked else None)  # fmt: skip


def _chunked(algorithm: Any) -> bool:
    """Bandwidth-optimal on one host's copies: every one of 4 towers sends 2(n-1)/n·S
    (a reduce-scatter and an all-gather of S/n chunks, whatever the schedule)."""
    record = getattr(algorithm, "algorithm", None)
    if not isinstance(record, allreduce.Algorithm) or record.estimated or not record.bytes_sent:
        return False
    sent = record.bytes_sent(4, 1 << 20, 4)
    return sent is not None and all(b == 3 * (1 << 20) // 2 for b in sent)


def _tf_contender(name: str, ops: tf.distribute.CrossDeviceOps, formula: str) -> Contender:
    from tensorflow.python.distribute import values as values_lib

    def body(values: list[tf.Tensor]) -> list[tf.Tensor]:
        per_replica = values_lib.PerReplica(values)
        mirrored = ops.reduce(tf.distribute.ReduceOp.SUM, per_replica, destinations=per_replica)
        return list(mirrored.values)

    return Contender(name, "tf.distribute", body, formula=formula)


def _calibration() -> list[Contender]:
    def send(values: list[tf.Tensor]) -> list[tf.Tensor]:
        return [allreduce.send(values[1], values[0].device)]

    def add(values: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.device(values[0].device):
            return [tf.add_n(values)]

    return [
        Contender("send", "calibration", send, formula="send", outputs="copy"),
        Contender("add", "calibration", add, formula="add", outputs="sum"),
        Contender(LEAF_ADDS, "calibration", leaf_adds, outputs="parts"),
        Contender(CHAIN_ADDS, "calibration", chain_adds, outputs="parts"),
        Contender(ASSEMBLY, "calibration", assembly, outputs="parts"),
    ]


def contenders(
    devices: Sequence[str], algorithms: Sequence[str] | None = None, *, calibration: bool = True
) -> list[Contender]:
    """Towers' algorithms, MirroredStrategy's two cross-device ops and the calibration pair.

    Args:
        devices: the towers' devices (tf.distribute's ops are built for them).
        algorithms: registry names (default: all of ``towers.ALGORITHMS``); the names
            ``"tf.CollectiveAllReduce"`` and ``"tf.ReductionToOneDevice"`` select those.
        calibration: add the ``send`` and ``add`` rows for the cost model.
    """
    from reference.mirrored import collective_all_reduce

    tf_ops = {
        "tf.CollectiveAllReduce": (collective_all_reduce(list(devices)), "ring"),
        "tf.ReductionToOneDevice": (tf.distribute.ReductionToOneDevice(), "naive"),
    }
    names = list(allreduce.ALGORITHMS) + list(tf_ops) if algorithms is None else list(algorithms)
    out = []
    for name in names:
        if name in tf_ops:
            ops, formula = tf_ops[name]
            out.append(_tf_contender(name, ops, formula))
        else:
            out.append(towers_contender(name))
    return out + (_calibration() if calibration and len(devices) > 1 else [])


def make_inputs(devices: Sequence[str], nbytes: int, seed: int = 0) -> list[tf.Tensor]:
    """One float32 tensor of ``nbytes`` per device, holding integers in [-64, 64]."""
    rng = np.random.default_rng(seed)
    count = nbytes // 4
    out = []
    for device in devices:
        data = rng.integers(-64, 65, size=count).astype(np.float32)
        with tf.device(device):
            out.append(tf.identity(tf.constant(data)))
    return out


class Compiled:
    """A contender compiled for one set of devices; ``homes`` are its outputs' devices.

    The devices are taken from the traced graph: an eager output of a ``tf.function``
    over logical CPUs reports the host CPU whatever device produced it.
    """

    def __init__(self, contender: Contender, devices: Sequence[str]) -> None:
        self.contender, self.devices = contender, list(devices)
        self.homes: list[str] = []
        self._fn = tf.function(self._placed, autograph=False)

    def _placed(self, *values: tf.Tensor) -> list[tf.Tensor]:
        moved = []
        for v, d in zip(values, self.devices):
            with tf.device(d):
                moved.append(tf.identity(v))
        outputs = self.contender.body(moved)
        self.homes = [canonical_device(o.device) for o in outputs]
        return outputs

    def __call__(self, *values: tf.Tensor) -> list[tf.Tensor]:
        return list(self._fn(*values))


def count_wrong(
    contender: Contender, outputs: Sequence[tf.Tensor], inputs: Sequence[np.ndarray],
    devices: Sequence[str], homes: Sequence[str],
) -> int:
    """Elements that differ from the exact answer, over all outputs (misplaced: all wrong).

    Args:
        homes: the device each output was placed on (from the traced graph).
    """
    total = inputs[0].copy()
    for x in inputs[1:]:
        total += x  # exact: small integers in float32
    if contender.outputs == "copy":
        expected, wanted = [inputs[1]], [devices[0]]
    elif contender.outputs == "sum":
        expected, wanted = [total], [devices[0]]
    else:
        expected, wanted = [total] * len(devices), list(devices)
    if len(outputs) != len(expected) or len(homes) != len(expected):
        return int(sum(e.size for e in expected))
    wrong = 0
    for out, want, home, should in zip(outputs, expected, homes, wanted):
        if canonical_device(home) != canonical_device(should):
            wrong += want.size
        else:
            wrong += int(np.count_nonzero(out.numpy().reshape(-1) != want))
    return wrong


def _bind(fn: Compiled, inputs: Sequence[tf.Tensor]) -> Callable[[], list[tf.Tensor]]:
    return lambda: fn(*inputs)


def _row(contender: Contender, n: int, nbytes: int, samples: Samples | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "size": nbytes, "count": nbytes // 4, "type": "float", "redop": "sum",
        "algorithm": contender.name, "kind": contender.kind, "n": n,
        "formula": contender.formula, "params": dict(contender.params),
        "time_us": None, "min_us": None, "cpu_us": None, "algbw": None, "busbw": None,
        "wrong": None, "error": "",
    }
    if samples is not None:
        seconds = samples.median
        row.update(time_us=seconds * 1e6, min_us=samples.minimum * 1e6,
                   cpu_us=samples.cpu_median * 1e6,
                   algbw=costmodel.algbw(nbytes, seconds) / 1e9,
                   busbw=costmodel.busbw(nbytes, seconds, n) / 1e9
                   if contender.kind != "calibration" else None)
    return row


def calls_per_sample(nbytes: int) -> int:
    """Calls averaged into one sample: 3 for messages up to 256 KB (sub-ms calls), else 1."""
    return 3 if nbytes <= 1 << 18 else 1


@dataclasses.dataclass
class _Size:
    """One size's inputs and compiled contenders (and the reasons of those that failed)."""

    nbytes: int
    inputs: list[tf.Tensor]
    compiled: dict[str, Compiled]
    errors: dict[str, str]


def _prepare(cands: Sequence[Contender], devices: Sequence[str], nbytes: int) -> _Size:
    """Make the inputs and trace every contender once (call under ``as_written``)."""
    if nbytes % 4:
        raise ValueError(f"sizes must be multiples of 4 bytes (float32), got {nbytes}")
    size = _Size(nbytes, make_inputs(devices, nbytes, seed=nbytes), {}, {})
    for c in cands:
        try:
            size.compiled[c.name] = Compiled(c, devices)
            size.compiled[c.name](*size.inputs)  # trace now, so a failure names its contender
        except Exception as err:  # a contender that cannot run here gets a row saying why
            size.compiled.pop(c.name, None)
            size.errors[c.name] = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return size


def _check(
    cands: Sequence[Contender], size: _Size, devices: Sequence[str], samples: dict[str, Samples]
) -> list[dict[str, Any]]:
    """One row per contender at ``size``: timings from ``samples``, #wrong from a fresh call."""
    host = [x.numpy() for x in size.inputs]
    rows = []
    for c in cands:
        row = _row(c, len(devices), size.nbytes, samples.get(f"{size.nbytes}|{c.name}"))
        row["chunked"] = c.chunked
        row["leaf_share"] = None if c.schedule is None else leaf_share(c.schedule(len(devices)))
        if c.name in size.compiled and c.outputs != "parts":
            fn = size.compiled[c.name]
            row["wrong"] = count_wrong(c, fn(*size.inputs), host, devices, fn.homes)
        row["error"] = size.errors.get(c.name, "")
        rows.append(row)
    return rows


def _one_pass_rows(
    runs: dict[int, OnePass], n: int, samples: dict[str, Samples]
) -> list[dict[str, Any]]:
    """The one-pass rows (kind ``calibration``; ``#wrong`` against the exact sum)."""
    rows = []
    for nbytes, run in runs.items():
        row = _row(Contender(ONE_PASS, "calibration", list, outputs="sum"), n, nbytes,
                   samples.get(f"{nbytes}|{ONE_PASS}"))
        exact = np.sum([x.astype(np.float64) for x in run.host], axis=0)
        row["wrong"] = int(np.count_nonzero(run() != exact))
        rows.append(row)
    return rows


def run_allreduce(
    devices: Sequence[str], sizes: Sequence[int] = SIZES, *,
    algorithms: Sequence[str] | None = None, rounds: int = 15, verbose: bool = False,
) -> list[dict[str, Any]]:
    """The whole table: every contender at every size, timed in one interleaved loop.

    Interleaving sizes as well as contenders lets load drift hit every size alike,
    so one contender's times across sizes (what the cost model fits) stay
    comparable. Everything runs inside one :func:`~towers.allreduce.machinery.ordering.as_written`
    block.

    Args:
        devices: the towers' devices.
        sizes: bytes per tower, multiples of 4.
        algorithms: see :func:`contenders`.
        rounds: samples per (size, contender); the median is reported.
        verbose: show a progress bar.

    Returns:
        One row (a dict, nccl-tests columns and more) per contender and size.
    """
    cands = contenders(devices, algorithms)
    with as_written():  # held throughout: flipping Grappler's options costs every call
        prepared = [_prepare(cands, devices, nbytes) for nbytes in sizes]
        calls: dict[str, Callable[[], Any]] = {f"{s.nbytes}|{name}": _bind(fn, s.inputs)
                 for s in prepared for name, fn in s.compiled.items()}
        one_pass = {s.nbytes: OnePass([x.numpy() for x in s.inputs])
                    for s in prepared if len(devices) > 1}
        calls.update({f"{nbytes}|{ONE_PASS}": run for nbytes, run in one_pass.items()})
        per_sample = {key: calls_per_sample(int(key.split("|")[0])) for key in calls}
        samples = interleave(calls, rounds, calls=per_sample, warmup=3, verbose=verbose,
                             label=f"all-reduce: {len(calls)} (size, algorithm) pairs")
        rows = [row for s in prepared for row in _check(cands, s, devices, samples)]
        return rows + _one_pass_rows(one_pass, len(devices), samples)


def cost_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows :func:`towers.bench.costmodel.fit` accepts: modelled, timed rows only."""
    return [
        {"algorithm": r["formula"], "n": r["n"], "nbytes": r["size"],
         "seconds": r["time_us"] * 1e-6, "params": r["params"], "name": r["algorithm"]}
        for r in rows if r["formula"] and r["time_us"]
    ]
