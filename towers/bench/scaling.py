"""Scaling of the compiled step: trace time and graph size against towers × buckets.

For every algorithm, tower count (2, 4, 8, 16: prefixes of the simulated devices)
and model depth, one ``TowerTrainer`` step is traced (``get_concrete_function``,
variables on the parameter device) and measured: seconds to trace, operations in
the graph, and sends recorded. A *bucket* is one all-reduce call, i.e. one
trainable variable here. The log-log slope of operations (and of trace seconds)
against ``towers × buckets`` says how the graph grows: 1 is linear; an algorithm
whose every tower sends ``n - 1`` chunks per tick (the ring: ``2n(n-1)`` sends per
bucket) tends to 2. Constant overheads pull a fit over all points below the true
exponent, so the check uses local exponents: between the two largest tower counts
(at the most buckets) and between the two bucket counts (at the most towers).

The models are narrow MLPs (width 16): the graph, not arithmetic, is measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from towers import allreduce
from towers.bench.timing import progress
from towers.step import TowerTrainer
from towers.training.models import mlp

__all__ = ["LINEAR_SLOPE", "TOWERS", "fit_slopes", "run_scaling", "trace_step"]

TOWERS = (2, 4, 8, 16)
DEPTHS = (1, 2)
"""Hidden layers of the scaling MLPs: 2·(depth + 1) trainable variables (buckets)."""
LINEAR_SLOPE = 1.15
"""Largest local log-log exponent still called linear."""
WIDTH = 16


def _op_count(graph: tf.Graph) -> int:
    """Ops of the step's graph and of every function it calls: the guarded reduce → apply
    sits in a ``tf.cond`` branch, a function of its own that the top graph only names."""
    definition = graph.as_graph_def()
    return len(definition.node) + sum(len(f.node_def) for f in definition.library.function)


def trace_step(algorithm: str, devices: Sequence[str], depth: int) -> dict[str, Any]:
    """Trace one step of a ``depth``-hidden-layer MLP over ``devices``; measure the graph."""
    sizes = (8, *([WIDTH] * depth), 4)
    trainer = TowerTrainer(
        lambda: mlp(sizes, seed=0), lambda: keras.optimizers.SGD(0.1),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        devices=list(devices), all_reduce=algorithm, variables="parameter_device",
    )
    n = len(devices)
    x = tf.zeros([2 * n, sizes[0]])
    y = tf.zeros([2 * n], tf.int32)
    start = time.perf_counter()
    concrete = trainer.step_function(x, y)
    seconds = time.perf_counter() - start
    stats = trainer.last_step_stats
    return {
        "algorithm": algorithm, "towers": n, "buckets": len(trainer.model.trainable_variables),
        "ops": _op_count(concrete.graph), "trace_s": seconds,
        "sends": len(stats.transfers) if stats else None, "error": "",
    }


def run_scaling(
    devices: Sequence[str], *, towers: Sequence[int] = TOWERS, depths: Sequence[int] = DEPTHS,
    algorithms: Sequence[str] | None = None, verbose: bool = False,
) -> list[dict[str, Any]]:
    """:func:`trace_step` for every algorithm × tower count × depth (a row each)."""
    names = list(allreduce.ALGORITHMS if algorithms is None else algorithms)
    counts = [t for t in towers if t <= len(devices)]
    bar = progress(len(names) * len(counts) * len(depths), verbose, "scaling: tracing steps")
    rows, k = [], 0
    for name in names:
        for n in counts:
            for depth in depths:
                try:
                    rows.append(trace_step(name, devices[:n], depth))
                except Exception as err:  # an algorithm that cannot run here gets a row
                    rows.append({"algorithm": name, "towers": n, "buckets": 2 * (depth + 1),
                                 "ops": None, "trace_s": None, "sends": None,
                                 "error": f"{type(err).__name__}: {err}"[:160]})
                k += 1
                bar.update(k)
    return rows


def _slope(x: Sequence[float], y: Sequence[float]) -> float:
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def _local_exponent(rows: Sequence[dict[str, Any]], vary: str, fixed: str) -> float | None:
    """d ln(ops) / d ln(vary) between its two largest values, at the largest ``fixed``."""
    at = max(r[fixed] for r in rows)
    pts = sorted((r[vary], r["ops"]) for r in rows if r[fixed] == at)
    if len(pts) < 2 or pts[-1][0] == pts[-2][0]:
        return None
    (x1, y1), (x2, y2) = pts[-2], pts[-1]
    return float(np.log(y2 / y1) / np.log(x2 / x1))


def fit_slopes(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per algorithm: how ops, sends and trace seconds grow with towers and buckets.

    Returns:
        One dict per algorithm: ``ops_slope``, ``sends_slope``, ``trace_slope`` (log-log
        fits against towers × buckets over all points: constant overheads pull them
        below 1), ``towers_exponent`` and ``buckets_exponent`` (local log-log slopes
        of ops between the two largest tower counts / bucket counts), ``ops_per_unit``
        (ops / (towers × buckets) at the largest size) and ``linear`` (both local
        exponents ``<= LINEAR_SLOPE``).
    """
    out = []
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        good = [r for r in rows if r["algorithm"] == name and r["ops"]]
        if len({r["towers"] * r["buckets"] for r in good}) < 2:
            continue
        units = [r["towers"] * r["buckets"] for r in good]
        biggest = max(good, key=lambda r: r["towers"] * r["buckets"])
        sends = [r["sends"] for r in good]
        by_towers = _local_exponent(good, "towers", "buckets")
        by_buckets = _local_exponent(good, "buckets", "towers")
        exponents = [e for e in (by_towers, by_buckets) if e is not None]
        out.append({
            "algorithm": name, "ops_slope": _slope(units, [r["ops"] for r in good]),
            "sends_slope": _slope(units, sends) if all(sends) else None,
            "trace_slope": _slope(units, [r["trace_s"] for r in good]),
            "towers_exponent": by_towers, "buckets_exponent": by_buckets,
            "ops_per_unit": biggest["ops"] / (biggest["towers"] * biggest["buckets"]),
            "linear": all(e <= LINEAR_SLOPE for e in exponents),
        })
    return out
